"""``nanolab fit / validate / test``: LightningCLI with nanolab's run settings.

On top of Lightning's own config groups (``trainer``, ``model``, ``data``, ``seed_everything``)
this adds ``run``: where the run lives, the global batch in tokens (from which gradient
accumulation is derived), evaluation cadence and resume policy. Derived values (vocabulary,
accumulation, validation interval, run directory) are filled in before anything is instantiated
and saved with the rest in ``<run_dir>/config.yaml``; ``--print_config`` shows the config as given.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from nanolab.callbacks.events import CallbackConfigError
from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import PrepareError
from nanolab.data.tokenizers import TokenizerError
from nanolab.data.windows import DataTooSmallError
from nanolab.model.config import ConfigError
from nanolab.training.autobatch import AutoBatchError, device_memory_bytes, plan_memory
from nanolab.training.module import GPTLightningModule


class RunConfigError(ValueError):
    """A ``run`` setting that cannot work."""


@dataclass
class RunConfig:
    """Where a run lives and how its steps are counted.

    Args:
        name: Run name: its directory is ``<root>/<name>``. ``null`` = ``<config stem>-<time>``.
            Give a fixed name to make a run resumable under the same directory.
        root: Folder holding run directories.
        global_batch_tokens: Tokens per optimizer step over all devices. Gradient accumulation
            is derived: ``global_batch_tokens / (micro_batch_size * block_size * world_size)``,
            which must be a whole number. ``null`` = no accumulation.
        eval_every_steps: Optimizer steps between validations.
        resume: ``auto`` continues from the run directory's newest complete checkpoint when
            there is one; ``never`` starts fresh; a path resumes from that checkpoint.
        fresh: Start a new run even though the run directory holds another one: its log,
            checkpoints and config are moved to ``<run_dir>/previous/`` (never deleted). Without
            it, a directory that holds a different run is refused.
        micro_batch_size: ``null`` = ``data.micro_batch_size``; an integer overrides it;
            ``auto`` = the largest micro-batch the memory estimator predicts fits on this GPU
            and divides the global batch (no trial-and-error OOM runs; on CPU the data's value).
    """

    name: str | None = None
    root: str = "runs"
    global_batch_tokens: int | None = None
    eval_every_steps: int = 250
    resume: str = "auto"
    fresh: bool = False
    micro_batch_size: int | Literal["auto"] | None = None


def world_size_of(trainer_cfg: Any) -> int:
    """Devices x nodes as the Trainer will resolve them (``auto`` = every visible GPU, or 1)."""
    devices = trainer_cfg.get("devices", "auto")
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, tuple)):
        n = len(devices)
    elif isinstance(devices, str) and "," in devices:
        n = len([d for d in devices.split(",") if d.strip()])
    elif devices in ("auto", -1, "-1", None):
        accelerator = str(trainer_cfg.get("accelerator", "auto"))
        n = 1
        if accelerator in ("auto", "gpu", "cuda"):
            import torch

            n = max(1, torch.cuda.device_count())
    else:
        n = int(devices)
    return n * nodes


def gradient_accumulation(
    global_batch_tokens: int | None, micro_batch_size: int, block_size: int, world_size: int
) -> int:
    """Micro-batches per optimizer step that make up ``global_batch_tokens``."""
    if global_batch_tokens is None:
        return 1
    per_step = micro_batch_size * block_size * world_size
    if global_batch_tokens <= 0 or global_batch_tokens % per_step != 0:
        raise RunConfigError(
            f"run.global_batch_tokens ({global_batch_tokens}) must be a positive multiple of "
            f"data.micro_batch_size x model.gpt.block_size x devices = {micro_batch_size} x "
            f"{block_size} x {world_size} = {per_step}; e.g. {max(1, round(global_batch_tokens / per_step)) * per_step}"
        )
    return global_batch_tokens // per_step


def default_run_name(stem: str) -> str:
    """``<config stem>-<YYYYmmdd-HHMMSS>``, the same in every process of one launch.

    Lightning's DDP launcher re-executes the command for ranks 1..N-1 a moment later, so the
    name is handed down through ``NANOLAB_RUN_NAME``; under SLURM the job id is used, which also
    survives a requeue. Other multi-process launchers (torchrun on several nodes) should set
    ``run.name``.
    """
    if name := os.environ.get("NANOLAB_RUN_NAME"):
        return name
    if job := os.environ.get("SLURM_JOB_ID"):
        name = f"{stem}-slurm{job}"
    else:
        name = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.environ["NANOLAB_RUN_NAME"] = name
    return name


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad config in one line (the key and what is wrong), not a usage screen."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        lines = [line.strip() for line in str(message).splitlines() if line.strip()]
        summary = " ".join(lines[:3])
        sys.stderr.write(f"nanolab: error: {summary}\n")
        sys.exit(2)


class NanolabCLI(LightningCLI):
    """LightningCLI for nanolab: ``run`` settings, derived accumulation, run directories."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(RunConfig, "run", fail_untyped=True)
        # One context length for model and data.
        parser.link_arguments("model.gpt.block_size", "data.block_size")
        # The run log, checkpoint rotation, budgets, throughput/MFU and the step progress bar.
        from nanolab.callbacks import (
            CostBudget,
            MetricsLog,
            RotatingCheckpoint,
            StepProgressBar,
            ThroughputMeter,
        )

        parser.add_lightning_class_args(MetricsLog, "log")
        parser.add_lightning_class_args(RotatingCheckpoint, "checkpoint")
        parser.add_lightning_class_args(CostBudget, "budget")
        parser.add_lightning_class_args(ThroughputMeter, "throughput")
        parser.add_lightning_class_args(StepProgressBar, "progress")
        parser.link_arguments("run.fresh", "log.fresh")
        # On by default: SIGTERM/SIGINT/SIGUSR1 -> finish the step, checkpoint, exit 75.
        # Registered last: its step-end hook must run after the other callbacks have counted
        # the step (log record, token clock), so the checkpoint it saves includes that step.
        from nanolab.callbacks.preemption import PreemptionHandler

        parser.add_lightning_class_args(PreemptionHandler, "preemption")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        run = cfg.run
        if run.name is None:
            stem = (
                Path(str(cfg.get("config", [None])[-1] or "run")).stem
                if cfg.get("config")
                else "run"
            )
            run.name = default_run_name(stem)
        run_dir = Path(run.root) / run.name
        cfg.trainer.default_root_dir = str(run_dir)

        # The vocabulary comes from the prepared data unless the config fixes it.
        data = TokenDataModule(**{k: v for k, v in cfg.data.items() if k != "__path__"})
        vocab = data.vocab_size  # prepares the dataset from data.source when needed
        gpt = cfg.model.gpt
        if gpt.vocab_size is None:
            gpt.vocab_size = vocab
        elif gpt.vocab_size < vocab:
            raise RunConfigError(
                f"the data's vocabulary ({vocab}) is larger than model.gpt.vocab_size "
                f"({gpt.vocab_size}); set model.gpt.vocab_size to null or >= {vocab}"
            )

        world = world_size_of(cfg.trainer)
        self._plan_micro_batch(cfg, world)
        accumulate = gradient_accumulation(
            run.global_batch_tokens, cfg.data.micro_batch_size, gpt.block_size, world
        )
        cfg.trainer.accumulate_grad_batches = accumulate
        # Fail now, not after start-up, when the data cannot fill one step of every rank.
        data.block_size = gpt.block_size
        data.check_fits(world)
        if run.eval_every_steps < 1:
            raise RunConfigError(f"run.eval_every_steps must be >= 1, got {run.eval_every_steps}")
        # The training stream is endless (steps, not epochs): validation is counted in
        # micro-batches, so one optimizer step = `accumulate` of them.
        cfg.trainer.val_check_interval = run.eval_every_steps * accumulate
        cfg.trainer.check_val_every_n_epoch = None
        self.run_config = run
        self.run_dir = run_dir
        from nanolab.callbacks.progress import reconcile_progress_bar

        reconcile_progress_bar(cfg)

    def _plan_micro_batch(self, cfg: Any, world: int) -> None:
        """Apply ``run.micro_batch_size`` and, on a GPU, check the estimate against its memory."""
        choice = cfg.run.micro_batch_size
        if isinstance(choice, int):
            if choice < 1:
                raise RunConfigError(f"run.micro_batch_size must be >= 1 or auto, got {choice}")
            cfg.data.micro_batch_size = choice
        device_memory = (
            device_memory_bytes() if str(cfg.trainer.get("accelerator")) != "cpu" else None
        )
        if device_memory is None:
            return  # CPU: no device memory to plan against
        try:
            nodes = int(cfg.trainer.get("num_nodes") or 1)
            plan = plan_memory(
                cfg.as_dict(), device_memory, choice == "auto", max(1, world // nodes)
            )
        except ValueError as err:  # the estimator cannot describe this config: say so, go on
            if isinstance(err, AutoBatchError):
                raise RunConfigError(str(err)) from None
            rank_zero_warn(f"memory estimate unavailable: {err}")
            return
        if choice == "auto":
            cfg.data.micro_batch_size = plan.micro_batch_size
            rank_zero_info(
                f"run.micro_batch_size auto: {plan.micro_batch_size} (predicted peak "
                f"{plan.predicted_bytes / 2**30:.1f} of {plan.device_bytes / 2**30:.1f} GiB)"
            )
        if plan.warning:
            rank_zero_warn(plan.warning)

    def before_fit(self) -> None:
        kwargs = self.config_init["fit"]
        kwargs["weights_only"] = True
        if kwargs.get("ckpt_path") is None and not self.run_config.fresh:
            # The newest *complete* checkpoint (a torn one is reported and skipped): resume.py.
            from dataclasses import asdict

            from nanolab.training.resume import ResumeError, resolve_resume

            gpt = getattr(self.model, "gpt_config", None)
            try:
                kwargs["ckpt_path"] = resolve_resume(
                    self.run_config.resume, self.run_dir, asdict(gpt) if gpt else None
                )
            except ResumeError as err:
                raise RunConfigError(str(err)) from None
        # Refuse to resume on data that changed under the run (file sizes, meta.json) before
        # anything is written; the DataModule checks again when the trainer restores it.
        check_data = getattr(self.datamodule, "check_resume", None)
        if callable(check_data):
            check_data(kwargs.get("ckpt_path"))
        # Refuse a directory holding a different run before anything (config.yaml) is written.
        from nanolab.callbacks.rundir import claim_run_dir

        claim_run_dir(
            self.run_dir,
            self.config[self.subcommand].as_dict(),
            resuming=kwargs.get("ckpt_path") is not None,
            fresh=self.run_config.fresh,
        )

    def before_validate(self) -> None:
        self.config_init["validate"]["weights_only"] = True  # a checkpoint is data, not code

    def before_test(self) -> None:
        self.config_init["test"]["weights_only"] = True


def trainer_defaults() -> dict[str, Any]:
    return {
        "max_steps": 5000,
        "logger": False,
        "use_distributed_sampler": False,  # the DataModule shards windows by rank itself
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
    }


USER_ERRORS = (
    ConfigError,
    PrepareError,
    TokenizerError,
    RunConfigError,
    DataTooSmallError,
    CallbackConfigError,  # includes RunDirError: a run directory held by another run
)


def run_lightning_cli(argv: list[str]) -> int:
    """Run ``fit``/``validate``/``test``; a bad value ends in one error line and exit code 2."""
    try:
        NanolabCLI(
            GPTLightningModule,
            TokenDataModule,
            # args=None lets LightningCLI read sys.argv itself (it warns when given both).
            args=None if argv == sys.argv[1:] else argv,
            trainer_defaults=trainer_defaults(),
            save_config_kwargs={"overwrite": True},
            seed_everything_default=1337,
            auto_configure_optimizers=False,
            parser_class=OneLineErrorParser,
        )
    except USER_ERRORS as err:
        print(f"nanolab {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    return 0
