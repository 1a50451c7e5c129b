"""Masked targets (y = -1): one mean over the targets of a whole optimizer step (for a data module
that declares ``masked_targets``), and of the whole validation set, whatever the micro-batch
layout; a batch without any target adds nothing. Without masks, every number is the one the
per-micro-batch means gave, to the bit; without the declaration the step is that code, op for op
(no count, no all-reduce of counts, no gradient scale), and masks found on the host say so once.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import nanolab.training.module as module_py
from nanolab.callbacks.syncs import SyncCounter
from nanolab.model import GPT, GPTConfig
from nanolab.training.grad_norm import clip_with_norm, norm_of, plain_on_one_device
from nanolab.training.masked_targets import holds_masked_targets, loss_or_zero, target_count
from nanolab.training.module import TRAIN_LOSS, GPTLightningModule
from nanolab.training.optim import OptimizerConfig, ScheduleConfig

VOCAB, BLOCK, WINDOWS = 32, 8, 16
TINY = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16, dropout=0.0)


def windows(masked: bool, fully_masked: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """WINDOWS windows of (x, y); with ``masked``, window i's first (5 * i) % BLOCK targets
    carry no loss (chat prompts of varying length), and ``fully_masked`` ones have none."""
    g = torch.Generator().manual_seed(0)
    chunk = torch.randint(0, VOCAB, (WINDOWS, BLOCK + 1), generator=g)
    x, y = chunk[:, :-1], chunk[:, 1:].clone()
    if masked:
        for i in range(WINDOWS):
            y[i, : (5 * i) % BLOCK] = -1
    for i in fully_masked:
        y[i] = -1
    return x, y


def batches(data: tuple[torch.Tensor, torch.Tensor], micro: int) -> DataLoader:
    """The windows in order, ``micro`` at a time (the last batch may be shorter)."""
    x, y = data
    cut = [(x[i : i + micro], y[i : i + micro]) for i in range(0, len(x), micro)]
    return DataLoader(cut, batch_size=None)


class Windows(L.LightningDataModule):
    """The windows as a data module, ``micro`` at a time; ``masked_targets`` as declared."""

    def __init__(self, data, micro: int, declared: bool) -> None:
        super().__init__()
        self.data, self.micro, self.masked_targets = data, micro, declared

    def train_dataloader(self) -> DataLoader:
        return batches(self.data, self.micro)


class Probe(L.Callback):
    """Each optimizer step's published loss and gradient norm, as the run log reads them."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.request_gradient_norm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.step_gradient_norm is not None:
            self.norms.append(pl_module.step_gradient_norm.clone())
            self.losses.append(trainer.callback_metrics[TRAIN_LOSS].clone())
            pl_module.step_gradient_norm = None


def fit(
    module_class, data, micro: int, accumulate: int, steps: int, clip: float | None = 1.0,
    declared: bool = True, fused: bool = False,
):  # fmt: skip
    """A fit from the seed; ``declared``: its data module declares masked targets."""
    L.seed_everything(0)
    optimizer = OptimizerConfig(fused=fused)
    module = module_class(gpt=TINY, optimizer=optimizer, schedule=ScheduleConfig(warmup_steps=1))
    probe = Probe()
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, callbacks=[probe],
    )  # fmt: skip
    trainer.fit(module, datamodule=Windows(data, micro, declared))
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return probe, weights


def validate(module: GPTLightningModule, data, micro: int) -> float:
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    return trainer.validate(module, dataloaders=batches(data, micro), verbose=False)[0]["val/loss"]


def token_mean_loss(model: GPT, data) -> torch.Tensor:
    """The mean cross-entropy over every target that carries a loss, in one call."""
    x, y = data
    logits, _ = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)


def test_accumulated_micro_batches_are_the_big_batch_with_masks():
    data = windows(masked=True)
    whole, whole_weights = fit(GPTLightningModule, data, micro=8, accumulate=1, steps=2)
    split, split_weights = fit(GPTLightningModule, data, micro=4, accumulate=2, steps=2)
    quarters, _ = fit(GPTLightningModule, data, micro=2, accumulate=4, steps=2)
    for other in (split, quarters):
        torch.testing.assert_close(torch.stack(other.losses), torch.stack(whole.losses))
        torch.testing.assert_close(torch.stack(other.norms), torch.stack(whole.norms))
    for key, value in whole_weights.items():
        torch.testing.assert_close(split_weights[key], value)
    # And it is the mean over the step's targets, not over its windows.
    L.seed_everything(0)
    start = GPTLightningModule(gpt=TINY).model
    first = (data[0][:8], data[1][:8])
    with torch.no_grad():
        torch.testing.assert_close(whole.losses[0], token_mean_loss(start, first))


def test_validation_is_one_mean_over_targets_whatever_the_micro_batch():
    data = windows(masked=True)
    L.seed_everything(0)
    module = GPTLightningModule(gpt=TINY)
    values = [validate(module, data, micro) for micro in (1, 4, 16)]
    with torch.no_grad():
        expected = token_mean_loss(module.model.eval(), data).item()
    assert values == pytest.approx([expected] * 3, rel=1e-6)


def test_a_fully_masked_micro_batch_adds_nothing_and_is_never_nan():
    data = windows(masked=True, fully_masked=(0, 3))
    L.seed_everything(0)
    module = GPTLightningModule(gpt=TINY)
    x, y = data
    _, loss = module.model(x[:1], y[:1])
    assert loss.isnan()  # the model's own loss: 0/0 (what the module guards, below)
    loss = loss_or_zero(loss, target_count(y[:1]))
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in module.model.parameters())
    # Validation: the two windows without targets change nothing, at any micro-batch size.
    kept = [i for i in range(WINDOWS) if i not in (0, 3)]
    with torch.no_grad():
        expected = token_mean_loss(module.model.eval(), (x[kept], y[kept])).item()
    assert [validate(module, data, micro) for micro in (1, 4)] == pytest.approx(
        [expected] * 2, rel=1e-6
    )
    # Training: one micro-batch per step, the first two steps' batches hold window 0 and 3.
    probe, weights = fit(GPTLightningModule, data, micro=1, accumulate=1, steps=4)
    assert all(math.isfinite(v.item()) for v in probe.losses[1:3] + probe.norms)
    # Steps 1 and 4 hold no target: gradient 0, and no loss (NaN: the run log writes null).
    assert probe.norms[0].item() == 0.0 and probe.losses[0].isnan() and probe.losses[3].isnan()
    assert all(v.isfinite().all() for v in weights.values())
    # Accumulated with a fully masked micro-batch: the same step as without it.
    with_empty, _ = fit(GPTLightningModule, data, micro=2, accumulate=2, steps=2)
    assert all(math.isfinite(v.item()) for v in with_empty.losses + with_empty.norms)


class PerMicroBatchMeans(GPTLightningModule):
    """The training and validation steps as they were before masks were weighed by targets:
    each micro-batch's own mean, the step the mean of those, validation weighed by windows."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits, _ = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        done = loss.detach()
        self._step_loss = done if self._step_loss is None else self._step_loss + done
        self._step_micro_batches += 1
        if self._ends_optimizer_step():
            mean = self._step_loss / self._step_micro_batches
            self._step_loss, self._step_micro_batches = None, 0
            self.publish_train_loss(mean)
        return loss

    def _eval_step(self, batch, stage):
        x, y = batch
        logits, _ = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        self.log(
            f"{stage}/loss", loss, prog_bar=stage == "val", sync_dist=True, batch_size=x.size(0)
        )

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        requested, self._norm_requested = self._norm_requested, False
        self.step_gradient_norm = None
        clip_val = float(gradient_clip_val or 0.0)
        if clip_val > 0 or requested:
            params = self._params_with_grads()
            grads = [p.grad for p in params]
            norm = self.step_gradient_norm = norm_of(grads)
            if clip_val > 0 and norm is not None and plain_on_one_device(grads):
                clip_with_norm(params, clip_val, norm)


@pytest.mark.parametrize("declared", [False, True], ids=["undeclared", "declared"])
@pytest.mark.parametrize("clip", [1.0, None], ids=["clip", "no-clip"])
def test_unmasked_data_gives_the_per_micro_batch_numbers_to_the_bit(clip, declared):
    data = windows(masked=False)
    new, new_weights = fit(
        GPTLightningModule, data, micro=4, accumulate=2, steps=2, clip=clip, declared=declared
    )
    old, old_weights = fit(PerMicroBatchMeans, data, micro=4, accumulate=2, steps=2, clip=clip)
    assert len(new.losses) == 2
    for a, b in zip(new.losses + new.norms, old.losses + old.norms, strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(new_weights[k], old_weights[k]) for k in old_weights)
    L.seed_everything(0)
    module = GPTLightningModule(gpt=TINY)
    reference = PerMicroBatchMeans(gpt=TINY)
    reference.model.load_state_dict(module.model.state_dict())
    for micro in (3, 16):  # 3: a last batch of one window
        assert validate(module, data, micro) == validate(reference, data, micro)


class Calls:
    """Counts the calls of the masked-target machinery through the training module's names."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[str, int] = {}
        self.clip_scales: list[object] = []
        for name in ("target_count", "loss_or_zero", "scale_gradients"):
            self._count(monkeypatch, module_py, name)
        for name in ("_masked_training_step", "_masked_step_mean_loss"):
            self._count(monkeypatch, GPTLightningModule, name)
        clip = module_py.clip_with_norm

        def recording_clip(params, max_norm, total_norm, scale=None):
            self.clip_scales.append(scale)
            return clip(params, max_norm, total_norm, scale)

        monkeypatch.setattr(module_py, "clip_with_norm", recording_clip)

    def _count(self, monkeypatch, owner, name: str) -> None:
        original = getattr(owner, name)
        self.counts[name] = 0

        def counted(*args, **kwargs):
            self.counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize(
    "clip, fused", [(1.0, False), (None, False), (1.0, True)], ids=["clip", "no-clip", "fused"]
)
def test_data_that_does_not_declare_masks_takes_the_plain_step(monkeypatch, clip, fused):
    """No count per micro-batch, no step-wide mean (so no all-reduce of counts under DDP or
    FSDP: that mean is where they are taken), no gradient scale, the clip's own multiply only;
    the same fit of a data module that declares masks goes through all of them (the seam is
    live). Mutation caught: reading the declaration as True, or scaling by an exact 1.0."""
    data = windows(masked=False)
    calls = Calls(monkeypatch)
    fit(GPTLightningModule, data, micro=4, accumulate=2, steps=2, clip=clip, fused=fused,
        declared=False)  # fmt: skip
    assert set(calls.counts.values()) == {0}, calls.counts
    assert calls.clip_scales == ([None, None] if clip else [])
    calls = Calls(monkeypatch)
    fit(GPTLightningModule, data, micro=4, accumulate=2, steps=2, clip=clip, fused=fused)
    assert calls.counts["target_count"] == calls.counts["_masked_training_step"] == 4
    assert calls.counts["_masked_step_mean_loss"] == 2
    scaled = calls.counts["scale_gradients"] + sum(s is not None for s in calls.clip_scales)
    assert scaled == 2, calls.counts


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if "masked_targets" in line]


def test_masks_a_data_module_did_not_declare_are_found_on_the_host_and_said_once(capsys):
    """Found in the first training batch that holds one (window 1 masks 5 targets), while it is
    a host tensor: one line naming the attribute and the class; the fit goes on (each
    micro-batch's mean counting the same). Validation, which weighs by targets anyway, is not
    looked at; neither is a batch on a device (it would take a sync), nor a declared module's."""
    data = windows(masked=True)
    fit(GPTLightningModule, data, micro=2, accumulate=1, steps=3, declared=False)
    (line,) = warnings_of(capsys.readouterr().err)
    assert line.startswith("nanolab fit: warning: ")
    assert f"{__name__}.Windows's training batches hold masked targets (y = -1)" in line
    assert f"set masked_targets = True on {__name__}.Windows" in line
    fit(GPTLightningModule, data, micro=2, accumulate=1, steps=3, declared=True)
    validate(GPTLightningModule(gpt=TINY), data, micro=4)
    assert warnings_of(capsys.readouterr().err) == []
    x, y = data
    assert holds_masked_targets((x, y)) and not holds_masked_targets((x, y.clamp(min=0)))
    on_a_device = torch.full((2, BLOCK), -1, device="meta")  # a CUDA batch's branch, on a CPU
    assert not holds_masked_targets((on_a_device, on_a_device))
    assert not holds_masked_targets(x) and not holds_masked_targets({"y": y})
    with SyncCounter().counting() as counter:  # host memory: nothing waits for a device
        holds_masked_targets((x, y))
    assert counter.count == 0


def test_validation_weighs_by_targets_without_a_host_sync():
    """The count per batch (a device tensor handed to Lightning as the batch size) costs no
    host-device sync: a validation takes as many as with the integer window count."""
    data = windows(masked=False)
    L.seed_everything(0)
    module, reference = GPTLightningModule(gpt=TINY), PerMicroBatchMeans(gpt=TINY)
    counts = []
    for each in (module, reference):
        validate(each, data, micro=4)  # warm: first-call set-up is not the point
        with SyncCounter().counting() as counter:
            validate(each, data, micro=4)
        counts.append(counter.count)
    assert counts[0] == counts[1], counts


def test_a_step_without_any_target_logs_no_loss_and_the_guards_leave_it_out(tmp_path, capsys):
    """With masked targets, an optimizer step whose micro-batches hold no target has no loss:
    its gradients are 0, its ``train/loss`` is null in the run log (it was 0, a perfect step
    to every reader), the spike guard keeps it out of its window of healthy losses (a median
    of such zeros made every later step a spike), and the divergence stop neither counts it
    nor lets it end a run of bad steps. ``report`` and ``status`` read the null."""
    import json

    from conftest import nanolab_here

    from nanolab.callbacks import MetricsLog
    from nanolab.callbacks.divergence import DivergenceStop
    from nanolab.callbacks.spike import SpikeGuard

    data = windows(masked=True, fully_masked=(0, 3))
    L.seed_everything(0)
    module = GPTLightningModule(gpt=TINY, schedule=ScheduleConfig(warmup_steps=1))
    spike, divergence = SpikeGuard(action="warn", window=50), DivergenceStop()
    run = tmp_path / "runs" / "masked"
    trainer = L.Trainer(
        default_root_dir=str(run), max_steps=6, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[MetricsLog(), spike, divergence],
    )  # fmt: skip
    trainer.fit(module, datamodule=Windows(data, 1, True))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["event"] == "train"]
    assert [r["step"] for r in train if r["loss"] is None] == [1, 4]
    assert all(r["loss"] > 0 for r in train if r["step"] not in (1, 4))
    assert [r["grad_norm"] for r in train if r["step"] in (1, 4)] == [0.0, 0.0]
    # The guard's window: the 4 steps with a loss (it watches the weighted micro-batch mean).
    assert len(spike.history) == 4 and all(v > 0 for v in spike.history)
    assert trainer.global_step == 6 and divergence.diverged_step is None
    # A run of bad steps goes on across a step without a target, and is not ended by it.
    divergence._observe(trainer, 7, [1.0, 0.0, 0.0])
    divergence._observe(trainer, 8, [0.0, 0.0, 0.0], no_target=True)
    assert (divergence.bad.count, divergence.bad.first) == (1, 7)
    for verb in (["report", str(run.parent)], ["status", str(run)]):
        res = nanolab_here(*verb, cwd=tmp_path)
        assert res.returncode == 0 and "Traceback" not in res.stderr, (verb, res.stderr)
