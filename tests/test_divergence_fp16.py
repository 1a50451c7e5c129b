"""The divergence check under fp16 mixed precision: a collapsed loss scale stops the run.

Every run here is a real Lightning fit of the tiny GPT under ``16-mixed`` with a real
``torch.amp.GradScaler``. On CPU, Lightning turns ``precision="16-mixed"`` into bf16, so the
CPU tests pass the same plugin a GPU run gets, ``MixedPrecision("16-mixed", "cpu")``: fp16
autocast, fp16 gradients, a scaler that finds non-finite gradients, skips the step and halves its
scale (the CUDA test at the end runs the GPU path, where the flags are read one step late).

The collapse is forced the way it happens: gradients beyond fp16's range whatever the scale. A
model whose loss is multiplied by 1e9 has finite losses (fp32, ~4e9) and gradients ~1e9 times
the model's, so the scaler skips every step and halves its scale from 2**16 on.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import nanolab_here, run_nanolab, tiny_overrides, write_config
from lightning.pytorch.plugins import MixedPrecision

from nanolab.callbacks.divergence import EXIT_DIVERGED, DivergenceStop
from nanolab.callbacks.events import CallbackConfigError, stop_reason
from nanolab.data.datamodule import TokenDataModule
from nanolab.model import GPTConfig
from nanolab.queue.db import NewJob, QueueDB
from nanolab.queue.runner import outcome
from nanolab.runlog import read_records
from nanolab.training.module import GPTLightningModule

#: The loss multiplier that puts every gradient out of fp16's range at any scale >= 1.
GAIN = 1e9

#: What the end record says when the default rule (patience 3, floor 1.0) stops a scaler that
#: starts at 2**16: 17 halvings take it to 0.5, the first scale below 1.
COLLAPSE = "fp16 loss scale collapsed: 17 consecutive optimizer steps skipped (scale 0.5)"

#: A module the CLI test imports from its working directory (``model.class_path``).
GAIN_MODULE = f'''
from nanolab.training.module import GPTLightningModule


class OverflowingGPT(GPTLightningModule):
    """The GPT with its training loss times {GAIN:g}: fp16 gradients overflow at any scale."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * {GAIN!r}
'''


class GainGPT(GPTLightningModule):
    """The GPT with its training loss times :data:`GAIN` (finite in fp32, not its gradients)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        return super().training_step(batch, batch_idx) * GAIN


class ScaleProbe(L.Callback):
    """The scaler's scale after every optimizer step (a sync per step: fine in a test) and the
    weights as training started (the model is built in ``configure_model``)."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = _weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _fit_fp16(
    data: Path,
    root: Path,
    model: GPTLightningModule,
    init_scale: float = 2.0**16,
    max_steps: int = 40,
    accelerator: str = "cpu",
    growth_interval: int = 2000,
) -> tuple[L.Trainer, DivergenceStop, ScaleProbe]:
    dm = TokenDataModule(dataset_dir=str(data), micro_batch_size=4, block_size=32)
    div, probe = DivergenceStop(), ScaleProbe()
    device = "cuda" if accelerator == "gpu" else "cpu"
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=growth_interval)
    trainer = L.Trainer(
        max_steps=max_steps, accelerator=accelerator, devices=1, logger=False,
        plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=root, use_distributed_sampler=False,
        callbacks=[probe, div],
    )  # fmt: skip
    trainer.fit(model, dm)
    return trainer, div, probe


def _tiny_gpt(cls: type[GPTLightningModule] = GPTLightningModule) -> GPTLightningModule:
    L.seed_everything(0)
    return cls(gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _longest_fall(scales: list[float], start: float) -> int:
    """Most optimizer steps in a row across which the scale fell (= steps the scaler skipped)."""
    longest = run = 0
    for before, after in itertools.pairwise([start, *scales]):
        run = run + 1 if after < before else 0
        longest = max(longest, run)
    return longest


def test_a_collapsed_fp16_loss_scale_stops_the_run(char_dataset, tmp_path):
    """Every step skipped, the loss finite: stopped after the 17th skip, when the scale left 1.

    Mutation caught: the callback before this check ran all 40 steps (no stop reason), having
    changed no weight.
    """
    model = _tiny_gpt(GainGPT)
    trainer, div, probe = _fit_fp16(char_dataset, tmp_path, model)
    assert trainer.precision_plugin.scaler is not None
    assert probe.scales == [2.0 ** (16 - k) for k in range(1, 18)]  # skipped, halved, every step
    assert trainer.global_step == 17
    assert stop_reason(trainer) == ("diverged", COLLAPSE)
    assert div.describe() == COLLAPSE
    assert div.hint() == (
        "on a GPU with bf16 (Ampere or newer), resume with --trainer.precision bf16-mixed; to "
        "stay on fp16, branch a new run with a "
        "lower model.optimizer.lr (a resume keeps it)"
    )
    assert div.record_fields(trainer, "end") == {
        "diverged_step": 1,
        "skipped_steps": 17,
        "loss_scale": 0.5,
    }
    # The run trained nothing: every weight is where it started.
    assert probe.initial and all(
        torch.equal(probe.initial[k], v) for k, v in _weights(model).items()
    )


def test_a_calibrating_fp16_scaler_is_not_stopped(char_dataset, tmp_path):
    """A scaler that starts far too high skips many steps in a row while it comes down, then
    trains: not a collapse (its scale never goes below 1), so the run goes to ``max_steps``.

    Mutation caught: stopping at ``patience`` consecutive skips alone would end this run at
    step 3 (the scaler here skips over 20 steps in a row first).
    """
    model = _tiny_gpt()
    trainer, div, probe = _fit_fp16(char_dataset, tmp_path, model, init_scale=2.0**40)
    assert _longest_fall(probe.scales, 2.0**40) > 3 * div.patience  # many skips in a row...
    assert min(probe.scales) >= 1.0  # ...none of them below the floor
    assert probe.scales[-1] == probe.scales[-2]  # settled: the last steps were taken
    assert trainer.global_step == 40 and stop_reason(trainer) == (None, None)
    assert div.diverged_step is None and div.record_fields(trainer, "end") == {}
    assert any(not torch.equal(probe.initial[k], v) for k, v in _weights(model).items())


def test_a_scaler_that_skips_after_each_growth_is_not_stopped(char_dataset, tmp_path):
    """Steady state of a healthy scaler: it raises the scale (here after every clean step) and
    skips the step that overflows at the raised scale. Isolated skips: the run goes on."""
    trainer, div, probe = _fit_fp16(
        char_dataset, tmp_path, _tiny_gpt(), init_scale=2.0**40, max_steps=60, growth_interval=1
    )
    steady = probe.scales[30:]
    rises = sum(after > before for before, after in itertools.pairwise(steady))
    falls = sum(after < before for before, after in itertools.pairwise(steady))
    assert rises >= 10 and falls >= 10  # grew and skipped, again and again
    assert trainer.global_step == 60 and stop_reason(trainer) == (None, None)
    assert div.diverged_step is None


def test_a_nan_loss_under_fp16_is_reported_as_non_finite(char_dataset, tmp_path):
    """A NaN loss under fp16 also makes the scaler skip; the stop names the NaN, after
    ``patience`` steps, not the scale (which is still far above the floor by then)."""

    class NanGPT(GPTLightningModule):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * float("nan")

    trainer, div, _ = _fit_fp16(char_dataset, tmp_path, _tiny_gpt(NanGPT))
    assert trainer.global_step == 3
    reason, detail = stop_reason(trainer)
    assert reason == "diverged" and detail.startswith("loss or gradient norm not finite")
    assert div.collapse is None and div.record_fields(trainer, "end") == {"diverged_step": 1}
    assert div.hint() is not None


@pytest.mark.parametrize("floor", [-1.0, float("nan"), float("inf"), "1", True])
def test_loss_scale_floor_must_be_a_finite_number_at_least_zero(floor):
    with pytest.raises(CallbackConfigError, match=r"divergence\.loss_scale_floor"):
        DivergenceStop(loss_scale_floor=floor)


def test_floor_zero_turns_the_loss_scale_check_off(char_dataset, tmp_path):
    """``loss_scale_floor: 0``: a collapsing run trains on (skipping) to ``max_steps``."""
    dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=32)
    div = DivergenceStop(loss_scale_floor=0)
    trainer = L.Trainer(
        max_steps=20, accelerator="cpu", devices=1, logger=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=[div],
    )  # fmt: skip
    trainer.fit(_tiny_gpt(GainGPT), dm)
    assert trainer.global_step == 20 and stop_reason(trainer) == (None, None)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0 ** (16 - 20)


def test_fit_exits_3_and_report_and_queue_name_the_collapse(char_dataset, tmp_path, monkeypatch):
    """``nanolab fit`` under fp16 whose scale collapses: exit 3, one line naming the cause, the
    ``end`` record (reason ``diverged``, the sentence in ``detail``), ``nanolab report`` and the
    queue's reading of the attempt. The fit runs in this process (exit 3 from a process of its
    own: test_adversarial's divergence test)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "overflow_gpt.py").write_text(GAIN_MODULE)
    cfg = tiny_overrides(char_dataset, work / "runs", trainer__max_steps=40, run__name="fp16")
    cfg["trainer"]["plugins"] = [
        {
            "class_path": "lightning.pytorch.plugins.MixedPrecision",
            "init_args": {"precision": "16-mixed", "device": "cpu"},
        }
    ]
    cfg["model"]["class_path"] = "overflow_gpt.OverflowingGPT"
    cfg["model"]["init_args"] = {"gpt": cfg["model"].pop("gpt")}
    cfg["checkpoint"] = {"every_n_steps": 5}
    path = write_config(work / "fp16.yaml", cfg)
    monkeypatch.syspath_prepend(str(work))  # overflow_gpt, as the working directory is for -m
    try:
        res = nanolab_here("fit", "--config", str(path), cwd=work)
    finally:
        sys.modules.pop("overflow_gpt", None)
    assert res.returncode == EXIT_DIVERGED, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "Traceback" not in res.stderr
    assert last.startswith(f"nanolab fit: diverged: {COLLAPSE}; stopped at step 17"), last
    # It said "lower the learning rate", which a resume keeps: the branch command, as a
    # non-finite loss's line names it (no checkpoint from before the skips: a new run).
    config = work / "runs" / "fp16" / "config.yaml"
    assert last.endswith(
        "; on a GPU with bf16 (Ampere or newer), resume with --trainer.precision bf16-mixed; to "
        "stay on fp16, no checkpoint of it was "
        "saved before the skipped steps: start a new run with a lower model.optimizer.lr (or a "
        f"higher model.schedule.warmup_steps): nanolab fit --config {config} --run.name "
        "fp16-lr6e-05 --model.optimizer.lr 6e-05"
    ), last
    run_dir = work / "runs" / "fp16"
    end = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("event") == "end"][-1]
    assert end["reason"] == "diverged" and end["detail"] == COLLAPSE
    assert (end["diverged_step"], end["skipped_steps"], end["loss_scale"]) == (1, 17, 0.5)
    train = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("event") == "train"]
    assert len(train) == 17 and all(r["loss"] is not None for r in train)  # finite (null: not)
    report = run_nanolab("report", str(work / "runs"), "--json", cwd=work)
    assert report.returncode == 0, report.stderr
    (row,) = [r for r in json.loads(report.stdout)["runs"] if r["run"] == "fp16"]
    assert row["status"] == "diverged"
    assert row["detail"] == "fp16 loss scale collapsed at step 1"
    new = NewJob("fp16", str(path), [], None, str(work), str(run_dir))
    (job,) = QueueDB(work / "q.db").add_jobs([new])
    status = outcome(job, res.returncode, since=end["time"] - 60)
    assert status == ("failed", "diverged at step 1 (fp16 loss scale collapsed)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_collapsed_loss_scale_stops_a_gpu_run(char_dataset, tmp_path):
    """The GPU path: flags read from pinned memory one step late, so the stop lands at step 17
    or 18; the record is the same."""
    trainer, div, _ = _fit_fp16(char_dataset, tmp_path, _tiny_gpt(GainGPT), accelerator="gpu")
    assert trainer.global_step in (17, 18)
    assert stop_reason(trainer) == ("diverged", COLLAPSE)
    assert div.record_fields(trainer, "end")["skipped_steps"] == 17


def test_a_steps_losses_and_norm_are_checked_in_one_device_op():
    """The step's check (``_any_not_finite``): scalars of mixed dtypes (a bf16-true loss, a
    float32 norm) and non-scalar values alike; any NaN or inf in any of them flags the step."""
    from nanolab.callbacks.divergence import _any_not_finite

    bf16, f32 = torch.bfloat16, torch.float32
    assert _any_not_finite([]) is None
    fine = [torch.tensor(2.5, dtype=bf16), torch.tensor(2.4, dtype=bf16), torch.tensor(1e4)]
    assert float(_any_not_finite(fine)) == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert float(_any_not_finite([*fine[:2], torch.tensor(bad, dtype=f32)])) == 1.0
        assert float(_any_not_finite([torch.tensor(bad, dtype=bf16), fine[2]])) == 1.0
    assert float(_any_not_finite([fine[0], torch.tensor([1.0, float("nan")])])) == 1.0
    assert _any_not_finite(fine).dtype == torch.bool


def test_a_run_of_skipped_steps_in_progress_survives_a_resume():
    """Under fp16 a checkpoint can fall inside a run of GradScaler-skipped steps (the weights
    stay finite): the run's counts are in the checkpoint, and the start of the resumed run does
    not reset them (they are reset at setup, before Lightning restores callback states)."""
    from nanolab.callbacks.divergence import DivergenceStop, Streak

    before = DivergenceStop(patience=3)
    before.bad, before.skipped = Streak(1, 40), Streak(2, 39)
    state = before.state_dict()
    after = DivergenceStop(patience=3)
    after.load_state_dict(state)
    after.on_run_start(None, None)  # type: ignore[arg-type]
    assert (after.bad, after.skipped) == (Streak(1, 40), Streak(2, 39))
    after.load_state_dict({})  # a checkpoint from before: nothing in progress
    assert (after.bad, after.skipped) == (Streak(), Streak())
    off = DivergenceStop(enabled=False)  # watches no step: nothing would ever end them
    off.load_state_dict(state)
    assert (off.bad, off.skipped, off.open_bad_streak) == (Streak(), Streak(), None)


def test_the_collapse_line_names_the_branch_from_before_the_skipped_steps(tmp_path):
    """A collapsed fp16 loss scale said "use bf16-mixed or lower the learning rate": a resume
    keeps its rate, so lowering it takes a branch. The line names the branch command, as a
    non-finite loss's does, from the newest checkpoint saved before the first skipped step
    (its scaler's scale was not collapsed yet; the steps skipped after it changed no weight)."""
    from types import SimpleNamespace

    run = tmp_path / "runs" / "dv"
    (run / "checkpoints").mkdir(parents=True)
    for step in (4, 6, 8, 12):
        (run / "checkpoints" / f"step-{step:08d}.ckpt").write_bytes(b"w")
    module = SimpleNamespace(optimizer_config=SimpleNamespace(lr=0.003))
    trainer = SimpleNamespace(default_root_dir=str(run), lightning_module=module)
    div = DivergenceStop()
    div.diverged_step, div.collapse = 7, (17, 0.5)
    start = run / "checkpoints" / "step-00000006.ckpt"
    assert div.hint(trainer) == (
        "on a GPU with bf16 (Ampere or newer), resume with --trainer.precision bf16-mixed; to "
        "stay on fp16, a resume keeps its "
        "model.optimizer.lr 0.003 and schedule, so branch a new run with a lower one (or a "
        "higher model.schedule.warmup_steps) from step 6, its newest checkpoint from before the "
        f"skipped steps: nanolab fit --config {run / 'config.yaml'} --run.name dv-lr0.0003 "
        f"--run.resume {start} --model.optimizer.lr 0.0003"
    )
