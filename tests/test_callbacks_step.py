"""The step-callback base: registration order changes nothing; the docs' own callback works."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_callbacks_runlog import MICRO, TOKENS_PER_MICRO_BATCH, events, fit

from nanolab.callbacks import (
    CostBudget,
    MetricsLog,
    RotatingCheckpoint,
    StepCallback,
    StepProgressBar,
    ThroughputMeter,
)
from nanolab.callbacks.divergence import DivergenceStop
from nanolab.callbacks.preemption import PreemptionHandler
from nanolab.runlog import read_records

DOCS = Path(__file__).resolve().parent.parent / "docs" / "callbacks.md"

#: Fields that measure time (or hold a random id / this process): they differ between any two runs.
VARYING = {
    "time", "elapsed_s", "gpu_hours", "goodput", "step_time_s", "tokens_per_s", "samples_per_s",
    "cost", "seconds", "write_seconds", "time_breakdown", "wall_hours", "step_s", "train_active_s",
    "launch_tokens_per_s",
    "remaining_gpu_hours", "improvement_per_gpu_hour", "projected_gain", "run_id", "run_dir",
    "run_name", "path", "pid", "argv", "git_commit", "git_dirty",
}  # fmt: skip


def steady(value: Any) -> Any:
    """``value`` without the fields in :data:`VARYING`, at any depth."""
    if isinstance(value, dict):
        out = {k: steady(v) for k, v in value.items() if k not in VARYING}
        if "history" in out:  # the budget's (step, gpu_hours, val_loss) triples
            out["history"] = [[step, loss] for step, _, loss in value["history"]]
        return out
    if isinstance(value, (list, tuple)):
        return [steady(v) for v in value]
    return value


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def every_callback() -> list[L.Callback]:
    """The callbacks ``nanolab fit`` registers, in its order; the budget stops the run at step 5."""
    step_tokens = 2 * TOKENS_PER_MICRO_BATCH  # accumulate=2
    return [
        MetricsLog(),
        RotatingCheckpoint(every_n_steps=2, keep_last=10, keep_best=1),
        CostBudget(max_tokens=5 * step_tokens, price_per_gpu_hour=1.0, patience=5),
        ThroughputMeter(),
        StepProgressBar(refresh_rate=1),
        DivergenceStop(),
        PreemptionHandler(),
    ]


def test_registration_order_changes_no_record_and_no_checkpoint(tmp_path, char_dataset):
    runs = {}
    # Names of one length: a checkpoint records its run directory, and a path a few characters
    # longer can move the archive's 64-byte-aligned records, so its size, by 64 bytes.
    for name, reorder in (("forward", list), ("reverse", lambda c: c[::-1])):
        L.seed_everything(1234, verbose=False)
        run = tmp_path / name
        fit(run, char_dataset, reorder(every_callback()), max_steps=8, eval_every=2,
            accumulate=2, enable_progress_bar=True)  # fmt: skip
        runs[name] = run

    listed, flipped = (read_records(r / "metrics.jsonl") for r in runs.values())
    # The budget stopped the run at step 5: a check, a stop record, a final save and validation
    # (an extra evaluation, off the schedule: the budget rules do not count it, so no record).
    assert [r["event"] for r in listed if r["step"] == 5] == ["train", "budget", "val",
                                                              "checkpoint", "end"]  # fmt: skip
    assert listed[-1]["reason"] == "budget" and listed[-1]["tokens"] == 5 * 2 * MICRO * 16
    assert_same(steady(listed), steady(flipped), "metrics.jsonl")

    names = {p.name for p in (runs["forward"] / "checkpoints").iterdir()}
    assert names == {"step-00000002.ckpt", "step-00000004.ckpt", "step-00000005.ckpt", "last.ckpt"}
    assert names == {p.name for p in (runs["reverse"] / "checkpoints").iterdir()}
    for name in sorted(names):
        a, b = (
            torch.load(r / "checkpoints" / name, map_location="cpu", weights_only=True)
            for r in runs.values()
        )
        assert a["callbacks"]["RotatingCheckpoint"]["val_by_step"]  # the deferred save saw its val
        assert_same(steady(a), steady(b), name)


# -- docs/callbacks.md, "Writing your own step callback" ---------------------------------------
def documented_callback() -> type:
    """The StepCallback subclass the docs show, executed as written."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    code = next(b for b in blocks if "(StepCallback)" in b)
    namespace: dict[str, Any] = {"__name__": "docs_callbacks_example"}
    exec(compile(code, str(DOCS), "exec"), namespace)  # our own docs page
    return namespace["StopBelowLoss"]


def test_the_documented_step_callback_stops_the_run(tmp_path, char_dataset):
    stop_below_loss = documented_callback()
    run = tmp_path / "run"
    # Registered first: its stop still comes before the checkpoint's final save (step_order).
    callbacks = [stop_below_loss(target=100.0, every_n_steps=3), MetricsLog(), RotatingCheckpoint()]
    trainer = fit(run, char_dataset, callbacks, max_steps=20, eval_every=100, accumulate=2)
    assert trainer.global_step == 3  # the first check, counted in optimizer steps
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "completed" and end["detail"].startswith("train/loss ")
    assert end["detail"].endswith("< 100.0") and end["step"] == 3
    assert (run / "checkpoints" / "step-00000003.ckpt").exists()

    # A target the tiny model never reaches: the run goes on to max_steps.
    trainer = fit(tmp_path / "far", char_dataset, [stop_below_loss(target=0.0)], max_steps=4)
    assert trainer.global_step == 4


def test_a_step_callback_sees_each_optimizer_step_once(tmp_path, char_dataset):
    from nanolab.callbacks import StepCallback

    class Recorder(StepCallback):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def on_run_start(self, trainer, pl_module):
            self.seen.append(("start", trainer.global_step))

        def on_micro_batch(self, trainer, pl_module, outputs):
            self.seen.append(("micro", trainer.global_step))

        def on_step(self, trainer, pl_module, step):
            self.seen.append(("step", step))

        def on_validated(self, trainer, pl_module, step):
            self.seen.append(("val", step))

    first, second = Recorder(), Recorder()
    fit(tmp_path / "run", char_dataset, [first, second], max_steps=2, eval_every=2, accumulate=3)
    # Three micro-batches per optimizer step; each event once per callback, whoever came first.
    micro = [("micro", 0), ("micro", 0), ("micro", 1)]
    expected = [("start", 0), *micro, ("step", 1), *[(k, s + 1) for k, s in micro], ("step", 2),
                ("val", 2)]  # fmt: skip
    assert first.seen == expected and second.seen == expected


@pytest.mark.parametrize("order", [10, 99])
def test_step_order_decides_who_acts_first(tmp_path, char_dataset, order):
    from nanolab.callbacks import StepCallback

    calls: list[str] = []

    class Probe(StepCallback):
        step_order = order

        def on_step(self, trainer, pl_module, step):
            calls.append("probe")

    class Anchor(StepCallback):
        step_order = 50

        def on_step(self, trainer, pl_module, step):
            calls.append("anchor")

    fit(tmp_path / "run", char_dataset, [Anchor(), Probe()], max_steps=1, eval_every=100)
    assert calls == (["probe", "anchor"] if order < 50 else ["anchor", "probe"])


def test_the_built_in_order_is_one_list_and_subclasses_keep_their_place():
    from nanolab.callbacks import MetricsLog, RotatingCheckpoint, StepCallback
    from nanolab.callbacks.budget import CostBudget
    from nanolab.callbacks.step import STEP_ORDER, order_of

    assert order_of(MetricsLog()) == 10 and order_of(CostBudget()) == 40
    assert order_of(RotatingCheckpoint()) == 10 * len(STEP_ORDER) == 80

    class MyLog(MetricsLog):
        pass

    class MyLate(MetricsLog):
        step_order = 90

    class Plain(StepCallback):
        pass

    assert order_of(MyLog()) == 10 and order_of(MyLate()) == 90 and order_of(Plain()) == 100


@pytest.mark.parametrize(
    "live, clip",
    [(True, None), (False, None), (True, 0.05)],
    ids=["callback_metrics", "self.log", "clip-by-norm"],
)
def test_a_step_publishes_its_loss_once_and_takes_one_gradient_norm(
    tmp_path, char_dataset, monkeypatch, live, clip
):
    """Host time per step: ``train/loss`` is published on the micro-batch that ends the
    optimizer step only, straight into ``trainer.callback_metrics`` (no ``self.log``, ~0.35 ms a
    call), and the run log and the divergence stop share one gradient norm. What the run log
    writes and a callback reads is every step's mean micro-batch loss (not its last one's). The
    fallback for a Lightning whose callback_metrics is a copy (``live`` False) logs it instead.
    One pass over the gradients a step (``torch._foreach_norm``), the clip's included: the clip
    by norm uses the norm the run log records, and really clips (the gradients the optimizer
    stepped with have the clip's norm). Mutations caught: publishing every micro-batch (4 per
    step here), one norm per callback or one more for the clip (2 per step), a clip that skips
    clipping, a published loss that is not the step's mean, ``self.log`` on the
    fast route, a fallback that drops the loss."""
    import nanolab.training.module as module_mod
    from nanolab.training.module import GPTLightningModule

    norms, published, logged, step_losses, seen, stepped = [0], [], [], {}, {}, []
    real_foreach_norm = torch._foreach_norm

    def counting_norm(*args, **kwargs):
        norms[0] += 1
        return real_foreach_norm(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting_norm)
    monkeypatch.setattr(module_mod, "callback_metrics_are_live", lambda trainer: live)
    real_log, real_step = GPTLightningModule.log, GPTLightningModule.training_step
    real_publish = GPTLightningModule.publish_train_loss

    def log(self, name, value, *args, **kwargs):
        logged.append((self.trainer.global_step, name))
        return real_log(self, name, value, *args, **kwargs)

    def publish(self, loss):
        published.append(self.trainer.global_step)
        return real_publish(self, loss)

    def training_step(self, batch, batch_idx):
        loss = real_step(self, batch, batch_idx)
        step_losses.setdefault(self.trainer.global_step + 1, []).append(float(loss))
        return loss

    class Reader(StepCallback):
        def on_run_start(self, trainer, pl_module):
            def after_step(optimizer, args, kwargs):  # the gradients the optimizer stepped with
                grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
                norm = torch.linalg.vector_norm(
                    torch.stack([g.norm() for g in grads if g is not None])
                )
                stepped.append(float(norm))

            trainer.optimizers[0].register_step_post_hook(after_step)

        def on_step(self, trainer, pl_module, step):
            seen[step] = float(trainer.callback_metrics["train/loss"])

    monkeypatch.setattr(GPTLightningModule, "log", log)
    monkeypatch.setattr(GPTLightningModule, "publish_train_loss", publish)
    monkeypatch.setattr(GPTLightningModule, "training_step", training_step)
    run = tmp_path / "run"
    fit(run, char_dataset, [MetricsLog(), DivergenceStop(), Reader()], max_steps=5,
        eval_every=100, accumulate=4, gradient_clip_val=clip)  # fmt: skip
    assert published == [0, 1, 2, 3, 4]
    train_logs = [step for step, name in logged if name == "train/loss"]
    assert train_logs == ([] if live else [0, 1, 2, 3, 4])
    assert norms[0] == 5
    train = events(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    for r in train:
        losses = step_losses[r["step"]]
        assert len(losses) == 4 and r["loss"] == pytest.approx(sum(losses) / 4, rel=1e-6)
        assert r["grad_norm"] > 0
    logged_norms = [r["grad_norm"] for r in train]
    if clip is None:
        assert stepped == pytest.approx(logged_norms, rel=1e-5)
    else:
        assert min(logged_norms) > 4 * clip  # the clip binds at every step
        assert stepped == pytest.approx([clip] * 5, rel=1e-4)
    assert seen == pytest.approx({r["step"]: r["loss"] for r in train}, rel=1e-6)


def test_lightnings_callback_metrics_is_the_dict_it_keeps():
    """publish_train_loss's fast route rests on this: an entry put in ``callback_metrics`` stays
    for the callbacks. A Lightning that hands out copies fails here (the module then falls back
    to ``self.log`` by itself, at ~0.35 ms a step)."""
    import lightning as L

    from nanolab.training.module import callback_metrics_are_live

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert callback_metrics_are_live(trainer)
    trainer.callback_metrics["x"] = 1.0
    assert trainer.callback_metrics["x"] == 1.0
