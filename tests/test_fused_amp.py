"""Fused AdamW under every precision, with and without clipping: the path CUDA takes, on CPU.

On a GPU ``model.optimizer.fused: null`` means torch's fused AdamW, and the GPT-2 recipes clip
at 1.0 under ``bf16-mixed``. torch runs the same fused kernel on CPU, so every test here takes
that path for real: a Lightning fit of the tiny GPT with ``fused=True``, against the same fit with
the per-tensor (``foreach``) AdamW. fp16 needs a real ``GradScaler("cpu")`` passed on purpose
(Lightning turns ``precision="16-mixed"`` into bf16 on a CPU).

Tolerance: the two AdamW kernels round differently in the last bits, so after 4 steps the
weights agree to ``atol=1e-5, rtol=1e-4`` (measured differences are below 2e-6 in fp32 and
bf16, 1e-5 under fp16's rounding of the scaled loss).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import QUICKSTART, nanolab_here, run_nanolab, tiny_overrides, write_config
from lightning.pytorch.plugins.precision import MixedPrecision

from nanolab.callbacks.jsonl import gradient_norm
from nanolab.data.datamodule import TokenDataModule
from nanolab.model import GPT, GPTConfig
from nanolab.runlog import read_records
from nanolab.training.module import GPTLightningModule
from nanolab.training.optim import OptimizerConfig, build_optimizer

PRECISIONS = ("32-true", "bf16-mixed", "fp16")
CLIP = 0.05  # well below the tiny GPT's gradient norm at lr 3e-3 (about 1-3): always active


class NormProbe(L.Callback):
    """The gradient norm where the run log reads it (``on_before_optimizer_step``) and the one
    the optimizer stepped with (a step post-hook: the gradients after the clip and any
    unscaling, still in place until the module frees them after the step)."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.stepped: list[float] = []
        self.stepped_max: list[float] = []  # the largest |gradient| element the step saw

    def on_train_start(self, trainer, pl_module) -> None:
        def after_step(optimizer, args, kwargs) -> None:
            grads = [
                p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
            self.stepped.append(
                float(
                    torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
                    )
                )
            )
            self.stepped_max.append(max(float(g.abs().max()) for g in grads))

        trainer.optimizers[0].register_step_post_hook(after_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.logged.append(float(gradient_norm(pl_module)))


def _fit(
    data, root, precision: str, fused: bool, clip: float, steps: int = 4, name: str = "adamw",
    algorithm: str = "norm",
):  # fmt: skip
    L.seed_everything(0)
    model = GPTLightningModule(
        gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0),
        optimizer=OptimizerConfig(name=name, lr=3e-3, fused=fused),
    )
    dm = TokenDataModule(dataset_dir=str(data), micro_batch_size=4, block_size=32)
    if precision == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        precision_args = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    else:
        precision_args = {"precision": precision}
    probe = NormProbe()
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=root, use_distributed_sampler=False,
        callbacks=[probe], **precision_args,
    )  # fmt: skip
    trainer.fit(model, dm)
    return model, trainer, probe


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("clip", [CLIP, 0.0], ids=["clip", "noclip"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fused_adamw_trains_like_the_unfused_one(char_dataset, tmp_path, precision, clip):
    """Mutations caught: dropping the clip for fused optimizers (weights differ, the stepped
    norm exceeds CLIP); not unscaling before the hooks under fp16 (the logged norm is x65536);
    unscaling twice (the update is 65536x too small, weights differ)."""
    fused, trainer, fused_probe = _fit(char_dataset, tmp_path / "f", precision, True, clip)
    assert trainer.optimizers[0].defaults["fused"] is True
    plain, _, plain_probe = _fit(char_dataset, tmp_path / "p", precision, False, clip)
    a, b = _weights(fused), _weights(plain)
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), key
    assert len(fused_probe.logged) == len(plain_probe.logged) == 4
    assert fused_probe.logged == pytest.approx(plain_probe.logged, rel=1e-3)
    assert max(fused_probe.logged) < 100  # true gradients, not loss-scaled ones
    if clip:
        assert min(fused_probe.logged) > 4 * CLIP  # the clip had work to do...
        assert max(fused_probe.stepped) <= CLIP * (1 + 1e-4)  # ...and the optimizer saw it done
    else:
        assert fused_probe.stepped == pytest.approx(fused_probe.logged, rel=1e-5)


CLIP_VALUE = 1e-4  # far below the tiny GPT's largest gradient elements: every step clips


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16"])
def test_fused_adamw_clips_by_value_like_the_unfused_one(char_dataset, tmp_path, precision):
    """``gradient_clip_algorithm: value`` with a fused AdamW (clipped by nanolab, as Lightning's
    AMP plugin refuses to) against the foreach AdamW (clipped by Lightning): after 3 steps the
    weights agree to ``atol=1e-5, rtol=1e-4`` and every gradient element the fused optimizer
    stepped on is within the clip value. Mutation caught: the fused optimizer's value clip
    dropped (its gradients reach ~1e-1, and AdamW's update direction, hence the weights,
    differ)."""
    fit = dict(clip=CLIP_VALUE, steps=3, algorithm="value")
    fused, trainer, fused_probe = _fit(char_dataset, tmp_path / "f", precision, True, **fit)
    assert trainer.optimizers[0].defaults["fused"] is True
    plain, _, plain_probe = _fit(char_dataset, tmp_path / "p", precision, False, **fit)
    a, b = _weights(fused), _weights(plain)
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-4), key
    assert len(fused_probe.stepped_max) == len(plain_probe.stepped_max) == 3
    assert min(fused_probe.logged) > 10 * CLIP_VALUE  # the clip had work to do...
    assert max(fused_probe.stepped_max) <= CLIP_VALUE * (1 + 1e-4)  # ...and it was done
    assert max(plain_probe.stepped_max) <= CLIP_VALUE * (1 + 1e-4)


def _adamw_groups_fused(optimizer: torch.optim.Optimizer) -> list[bool]:
    """Whether each AdamW parameter group steps with the fused kernel (Muon's own groups, which
    have no such kernel, left out)."""
    return [
        bool(g["fused"]) for g in optimizer.param_groups if g.get("nanolab_optimizer") != "muon"
    ]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_fused_null_means_fused_on_cuda_only(name):
    """``model.optimizer.fused: null`` decides by the run's device: the builder is given
    ``cuda`` (the CPU parameters are what torch's fused AdamW also steps on a CPU) and builds
    the fused AdamW (Muon: its AdamW half), given ``cpu`` it does not; ``true``/``false`` win
    over the device. Mutation caught: ``null`` read as ``false`` (no run ever fused)."""
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    built = {
        (fused, device.type): _adamw_groups_fused(
            build_optimizer(model, OptimizerConfig(name=name, fused=fused), device)
        )
        for fused in (None, True, False)
        for device in (cuda, cpu)
    }
    assert all(built[None, "cuda"]) and built[None, "cuda"]
    assert not any(built[None, "cpu"])
    assert all(built[True, "cpu"]) and not any(built[False, "cuda"])


def test_an_fp16_overflow_still_skips_the_fused_step(char_dataset, tmp_path):
    """Unscaling early must keep GradScaler's inf check: a scale that overflows fp16 makes the
    first steps skip (weights unchanged, scale halved), then training proceeds."""
    L.seed_everything(0)
    model = GPTLightningModule(
        gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0),
        optimizer=OptimizerConfig(lr=3e-3, fused=True),
    )
    dm = TokenDataModule(
        dataset_dir=str(data_dir := char_dataset), micro_batch_size=4, block_size=32
    )
    assert data_dir.is_dir()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # loss x 2^40 overflows fp16
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, gradient_clip_val=1.0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, dm)
    before = _weights(model)
    assert scaler.get_scale() < 2.0**40  # the overflow was found and the scale backed off
    state = trainer.optimizers[0].state
    assert all(float(s["step"]) == 0 for s in state.values())  # and the step was skipped
    assert all(torch.isfinite(v).all() for v in before.values())


@pytest.mark.parametrize("name", ["muon", "adamw8bit"])
def test_other_optimizers_clip_under_bf16(char_dataset, tmp_path, name):
    """Muon (its AdamW part fused) and 8-bit AdamW under bf16 with clipping: they train and the
    optimizer steps on clipped gradients."""
    if name == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    model, _, probe = _fit(char_dataset, tmp_path, "bf16-mixed", True, CLIP, steps=3, name=name)
    assert max(probe.stepped) <= CLIP * (1 + 1e-3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_issue_reproduction_trains_through_the_cli(char_dataset, tmp_path):
    """``fit`` with bf16-mixed, fused AdamW and the quickstart's clip at 1.0: 3 steps, a finite
    loss, exit 0 (it stopped at step 1 before)."""
    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    res = nanolab_here(  # the CLI's entry point, in this process
        "fit", "--config", str(QUICKSTART), "--config", str(cfg), "--trainer.max_steps", "3",
        "--trainer.precision", "bf16-mixed", "--model.optimizer.fused", "true", cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    train = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in train)


def _strategy_weights(tmp_path, char_dataset, strategy: str, fused: bool) -> dict:
    name = f"{strategy}-{'fused' if fused else 'foreach'}"
    cfg = write_config(
        tmp_path / f"{name}.yaml",
        tiny_overrides(
            char_dataset, tmp_path / "runs", trainer__max_steps=4, run__name=name,
            model__gpt__dropout=0.0, run__global_batch_tokens=4 * 32 * 2,
        ),
    )  # fmt: skip
    res = run_nanolab(
        "fit", "--config", str(QUICKSTART), "--config", str(cfg),
        "--config", str(QUICKSTART.parent / "strategy" / f"{strategy}.yaml"),
        "--trainer.devices", "2", "--trainer.precision", "bf16-mixed",
        "--model.optimizer.fused", str(fused).lower(), "--model.optimizer.lr", "3e-3",
        "--trainer.gradient_clip_val", str(CLIP), cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = torch.load(tmp_path / "runs" / name / "checkpoints" / "last.ckpt", weights_only=True)
    return {k: v.float() for k, v in ckpt["state_dict"].items()}


@pytest.mark.slow  # 4 two-process fits, ~1 min each on 2 cores
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fused_adamw_with_clipping_under_ddp_and_fsdp2(tmp_path, char_dataset, strategy):
    """bf16-mixed, clip 0.05 (always active), 2 processes: the fused run trains to the weights
    of the foreach run (atol 1e-5, rtol 1e-4 after 4 steps). It stopped at step 1 before."""
    fused = _strategy_weights(tmp_path, char_dataset, strategy, True)
    plain = _strategy_weights(tmp_path, char_dataset, strategy, False)
    assert fused.keys() == plain.keys()
    for key in fused:
        assert torch.allclose(fused[key], plain[key], atol=1e-5, rtol=1e-4), key
