"""The baseline: a plain PyTorch training loop with nanolab's model, data, optimizer and schedule.

Written for the speed benchmark only. It reads the resolved ``config.yaml`` of a nanolab run
(so both sides train the same model on the same windows with the same batch, accumulation,
precision, clipping, optimizer and LR schedule) and does what a careful hand-written loop does:
no framework, no callbacks, no logging but a loss read every ``log_every`` steps. With
``--checkpoint-dir`` (as ``nanolab bench`` runs it) it also validates, scores the task suite and
saves at the config's cadence, as ``fit`` does (:mod:`nanolab.bench.plain_evals`).

``--driver lightning`` trains the same setup under a bare Lightning ``Trainer`` instead (no
callbacks, logger, checkpointing, progress bar or ``self.log``): the difference between the two
drivers is what Lightning's own loop costs per step, and ``nanolab fit`` minus it is what
nanolab's callbacks and logging cost (``nanolab bench --floor``).

Run as ``python -m nanolab.bench.plain_loop --config runs/x/config.yaml --steps 200 --out t.json
[--checkpoint-dir saves/]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from nanolab.data.datamodule import TokenWindows
from nanolab.data.prepare import read_meta
from nanolab.data.windows import WindowPlan
from nanolab.model import GPT, GPTConfig
from nanolab.training.optim import OptimizerConfig, ScheduleConfig, WarmupCosine, build_optimizer

#: ``*-true`` precisions: the model's weights in this dtype, no autocast (as Lightning does).
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def trained_precision(precision: Any, device: torch.device) -> str:
    """The precision Lightning really trains ``trainer.precision`` with on ``device``: short
    spellings and null named as Lightning names them, and ``16-mixed`` on a CPU is bf16-mixed
    (Lightning's CPU AMP has no fp16), so the plain loop trains what ``nanolab fit`` trains."""
    from nanolab.training.resolve import precision_name

    name = precision_name(precision)
    if name == "16-mixed" and device.type == "cpu":
        return "bf16-mixed"
    return name


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


@dataclass
class Setup:
    """What both drivers train: the model, optimizer, schedule and batches of a run's config."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: str
    accumulate: int
    clip: float | None
    clip_algorithm: str  # "norm" or "value", as trainer.gradient_clip_algorithm
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # micro-batch g, on the device
    micro_batch_size: int
    token_dtype: str  # of the prepared dataset's token files
    tokens_per_step: int


def build(config: dict[str, Any], device: torch.device, precision: str | None = None) -> Setup:
    """The model, optimizer, LR schedule and data windows of ``config``, as ``nanolab fit``
    builds them on one device (the same resolver, seed, windows and optimizer factory).
    ``precision``: the one to train with instead of what Lightning makes of the config's on
    ``device`` (a CPU test of the GPU's fp16 path)."""
    from nanolab.training.resolve import resolve

    # The same resolver as `nanolab fit` on one device: micro-batch, accumulation, block size.
    resolved = resolve(config, visible_gpus=1, devices=1, num_nodes=1)
    model_cfg, data_cfg, trainer_cfg = resolved.model_args, resolved.data_args, config["trainer"]
    torch.manual_seed(int(config.get("seed_everything") or 0))
    gpt = GPTConfig(**model_cfg["gpt"])
    precision = precision or trained_precision(trainer_cfg.get("precision"), device)
    model = GPT(gpt).to(device, dtype=TRUE_DTYPES.get(precision))
    if model_cfg.get("compile"):
        model.compile(mode=model_cfg.get("compile_mode"))
    opt_cfg = OptimizerConfig(
        **{**model_cfg["optimizer"], "betas": tuple(model_cfg["optimizer"]["betas"])}
    )
    sched_cfg = ScheduleConfig(**model_cfg["schedule"])
    optimizer = build_optimizer(model, opt_cfg, device)
    decay = sched_cfg.decay_steps or int(trainer_cfg["max_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(sched_cfg.warmup_steps, decay, sched_cfg.min_lr_ratio)
    )
    accumulate = int(resolved.accumulate or 1)
    clip = trainer_cfg.get("gradient_clip_val")

    dataset_dir = Path(data_cfg["dataset_dir"])
    meta = read_meta(dataset_dir)
    assert meta is not None, f"{dataset_dir} holds no prepared dataset"
    windows = TokenWindows(dataset_dir / "train.bin", meta["dtype"], gpt.block_size)
    plan = WindowPlan(
        num_tokens=int(meta["train_tokens"]),
        block_size=gpt.block_size,
        micro_batch_size=int(resolved.micro_batch_size or data_cfg["micro_batch_size"]),
        world_size=1,
        seed=int(data_cfg["seed"]),
    )
    pin = device.type == "cuda"

    def batch(g: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = windows[plan.batch_starts(g, 0)]
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    model.train()
    return Setup(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        accumulate=accumulate,
        clip=float(clip) if clip else None,
        clip_algorithm=str(trainer_cfg.get("gradient_clip_algorithm") or "norm"),
        batch=batch,
        micro_batch_size=plan.micro_batch_size,
        token_dtype=str(meta["dtype"]),
        tokens_per_step=plan.micro_batch_size * gpt.block_size * accumulate,
    )


def _progress(step: int, steps: int, side: str = "plain loop") -> None:
    """A line to stderr every 10 steps (the bench streams it): a run stopped from outside
    shows how far it got."""
    if step % 10 == 0 or step == steps - 1:
        print(f"{side}: step {step + 1}/{steps}", file=sys.stderr, flush=True)


def _clip(model: torch.nn.Module, clip: float, algorithm: str) -> None:
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(model.parameters(), clip)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)


def train(
    config: dict[str, Any],
    steps: int,
    device: torch.device,
    log_every: int = 1,
    precision: str | None = None,
    checkpoint_dir: Path | None = None,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; return the wall time at the end of each one.

    The loss is read every ``log_every`` steps: every step by default, the one host sync per
    step that ``nanolab fit`` makes too. ``precision``: see :func:`build`. ``checkpoint_dir``:
    also validate, score tasks and save checkpoints there at the config's cadence, as ``fit``
    does (:mod:`nanolab.bench.plain_evals`); the steps followed by such work are returned as
    ``busy_steps``."""
    s = build(config, device, precision)
    model, optimizer, scheduler, precision = s.model, s.optimizer, s.scheduler, s.precision
    accumulate, clip, batch = s.accumulate, s.clip, s.batch
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
    between = None
    if checkpoint_dir is not None:
        from nanolab.bench.plain_evals import between_steps

        between = between_steps(
            config, s, lambda: _autocast(precision, device), device, checkpoint_dir
        )
    step_ends: list[float] = []
    losses: list[tuple[int, float]] = []  # (optimizer step, 1-based; its micro-batches' mean)
    busy_steps: list[int] = []  # steps followed by a validation, task scoring or checkpoint
    g = 0
    for step in range(steps):
        total = None  # the step's loss as nanolab logs it: the mean over its micro-batches
        for _ in range(accumulate):
            x, y = batch(g)
            g += 1
            with _autocast(precision, device):
                _, loss = model(x, y)
            total = loss.detach() if total is None else total + loss.detach()
            scaler.scale(loss / accumulate).backward()
        if clip:
            scaler.unscale_(optimizer)
            _clip(model, clip, s.clip_algorithm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % log_every == 0 or step == steps - 1:
            losses.append((step + 1, (total / accumulate).item()))  # the one host sync
        if device.type == "cuda" and step == steps - 1:
            torch.cuda.synchronize()  # the last step ends when its queued work is done
        step_ends.append(time.time())
        _progress(step, steps)
        if between is not None and between.after_step(step + 1, last=step == steps - 1):
            busy_steps.append(step + 1)
    result = {"step_ends": step_ends, "losses": losses, "tokens_per_step": s.tokens_per_step}
    if between is not None:
        between.at_end(steps)
        result.update(
            busy_steps=busy_steps,
            val_losses=between.val_losses,
            task_scores=between.task_scores,
            time_breakdown=between.seconds,
        )
    return result


def train_lightning(
    config: dict[str, Any], steps: int, device: torch.device, precision_plugin: Any = None
) -> dict[str, Any]:
    """The same training under a bare Lightning ``Trainer``: Lightning's loop, closure,
    accumulation, precision plugin and clipping, and nothing of nanolab's (no callbacks, no
    logger, no ``self.log``). The loss is read once per step, as :func:`train` reads it.

    ``precision_plugin``: Lightning's plugin to train with instead of the config's precision
    (a ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`` runs the GPU's fp16
    path on a CPU, where Lightning would train bf16)."""
    import logging
    import warnings

    import lightning as L

    from nanolab.estimator.measure_trainer import BARE_TRAINER
    from nanolab.training.fused_amp import clip_gradients, handles_unscaling, step_closure

    s = build(config, device, getattr(precision_plugin, "precision", None))
    step_ends: list[float] = []
    losses: list[tuple[int, float]] = []

    class Bare(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = s.model
            self.last_loss: torch.Tensor | None = None

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
            _, loss = self.model(*batch)
            first = batch_idx % s.accumulate == 0  # the step's mean, as nanolab logs it
            done = loss.detach() / s.accumulate
            self.last_loss = done if first or self.last_loss is None else self.last_loss + done
            return loss  # Lightning divides by the accumulation itself

        def configure_optimizers(self) -> dict[str, Any]:
            schedule = {"scheduler": s.scheduler, "interval": "step"}
            return {"optimizer": s.optimizer, "lr_scheduler": schedule}

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
            # As GPTLightningModule: under fp16, a fused optimizer's gradients are unscaled
            # right after the backward, so the clip below sees true gradients.
            closure = step_closure(self.trainer, optimizer, optimizer_closure)
            super().optimizer_step(epoch, batch_idx, optimizer, closure)

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ) -> None:
            # Lightning's AMP plugin refuses to clip for a fused optimizer (fused_amp.py)
            if handles_unscaling(optimizer):
                algorithm = gradient_clip_algorithm or "norm"
                clip_gradients(optimizer, gradient_clip_val or 0.0, algorithm)
            else:
                super().configure_gradient_clipping(
                    optimizer, gradient_clip_val, gradient_clip_algorithm
                )

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % s.accumulate == 0:  # an optimizer step ended
                assert self.last_loss is not None
                losses.append((self.trainer.global_step, self.last_loss.item()))
                step_ends.append(time.time())
                _progress(self.trainer.global_step - 1, steps, "bare Lightning loop")

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            for g in range(steps * s.accumulate):
                yield s.batch(g)

    # Lightning's start-up notes (accelerators, tips) and deprecation warnings are not the
    # bench's output; both are put back afterwards.
    log = logging.getLogger("lightning.pytorch")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deprecated.*")
            trainer = L.Trainer(
                accelerator=device.type,
                devices=1,
                max_steps=steps,
                **(
                    {"plugins": [precision_plugin]}
                    if precision_plugin is not None
                    else {"precision": s.precision}
                ),
                accumulate_grad_batches=s.accumulate,
                gradient_clip_val=s.clip,
                gradient_clip_algorithm=s.clip_algorithm,
                **BARE_TRAINER,
            )
            # Its own generator: a DataLoader's iterator draws a seed, which would otherwise
            # come from the global RNG and change the dropout masks against the plain loop's.
            loader = torch.utils.data.DataLoader(
                Batches(), batch_size=None, generator=torch.Generator().manual_seed(0)
            )
            trainer.fit(Bare(), train_dataloaders=loader)
    finally:
        log.setLevel(level)
    if device.type == "cuda":
        torch.cuda.synchronize()
        step_ends[-1] = time.time()
    return {"step_ends": step_ends, "losses": losses, "tokens_per_step": s.tokens_per_step}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanolab.bench.plain_loop")
    parser.add_argument("--config", required=True, help="a nanolab run's resolved config.yaml")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--driver", choices=("plain", "lightning"), default="plain", help="the loop that trains"
    )
    parser.add_argument(
        "--checkpoint-dir",
        help="plain driver: also validate, score tasks and save checkpoints here at the "
        "config's cadence, as nanolab fit does (without it: training steps only)",
    )
    args = parser.parse_args(argv)
    config = yaml.safe_load(Path(args.config).read_text())
    device = torch.device(args.device)
    if args.driver == "plain":
        saves = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        result = train(config, args.steps, device, checkpoint_dir=saves)
    else:
        result = train_lightning(config, args.steps, device)
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
