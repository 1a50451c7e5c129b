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

from nanolab.callbacks.checkpoint_io import CheckpointWriteError
from nanolab.callbacks.events import CallbackConfigError
from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import PrepareError
from nanolab.data.tokenizers import TokenizerError
from nanolab.data.windows import DataTooSmallError
from nanolab.model.config import ConfigError
from nanolab.training.autobatch import (
    AutoBatchError,
    HostMemoryError,
    device_memory_bytes,
    plan_memory,
)
from nanolab.training.module import GPTLightningModule


class RunConfigError(ValueError):
    """A ``run`` setting that cannot work."""


@dataclass
class RunConfig:
    """Where a run lives and how its steps are counted.

    Args:
        name: Run name: its directory is ``<root>/<name>``. ``null`` = ``<config stem>-<time>``.
            Give a fixed name to make a run resumable under the same directory. A plain folder
            name: no ``/``, not empty, ``.`` or ``..`` (the run must stay inside ``root``).
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
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` for GPU runs:
            ``high`` (default) lets ``32-true`` matmuls use TF32 tensor cores (8x the FP32 rate
            on an A100, 10 mantissa bits per product, FP32 accumulation); ``highest`` keeps
            full FP32. 16-bit precisions do not use it. CPU runs are left as they are. The
            estimator, the MFU denominator and ``nanolab estimate`` follow this setting.
    """

    name: str | None = None
    root: str = "runs"
    global_batch_tokens: int | None = None
    eval_every_steps: int = 250
    resume: str = "auto"
    fresh: bool = False
    micro_batch_size: int | Literal["auto"] | None = None
    float32_matmul_precision: Literal["highest", "high", "medium"] = "high"


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


def apply_float32_matmul_precision(value: str, trainer_cfg: Any) -> None:
    """Set the FP32 matmul precision for a GPU run (a CPU run keeps torch's default)."""
    if str(trainer_cfg.get("accelerator", "auto")) == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(value)


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


def check_run_name(name: Any) -> None:
    """Refuse a run name that would put the run directory outside ``run.root`` (or be ``root``)."""
    text = str(name) if name is not None else ""
    if (
        not text.strip()
        or text in (".", "..")
        or "/" in text
        or "\\" in text
        or "\0" in text
        or Path(text).is_absolute()
    ):
        raise RunConfigError(
            f"run.name {text!r}: give a plain folder name (no '/', not empty, '.' or '..'); "
            "the run directory is run.root/run.name, set run.root to put it elsewhere"
        )


def check_max_steps(max_steps: Any) -> None:
    """Steps, not epochs: a positive number, or -1 (no limit: a budget or a signal stops it)."""
    if (
        isinstance(max_steps, bool)
        or not isinstance(max_steps, int)
        or not (max_steps >= 1 or max_steps == -1)
    ):
        raise RunConfigError(
            f"trainer.max_steps must be a positive number of optimizer steps (or -1: no limit, "
            f"stop on a budget), got {max_steps!r}"
        )


def check_model_settings(model: Any) -> None:
    """Validate ``model.gpt``/``optimizer``/``schedule`` before anything is derived from them,
    so an error names the model key (``block_size`` is also linked into ``data``)."""
    from nanolab.model.config import GPTConfig
    from nanolab.training.optim import OptimizerConfig, ScheduleConfig

    def plain(node: Any) -> dict[str, Any]:
        data = node.as_dict() if hasattr(node, "as_dict") else dict(node or {})
        return {k: v for k, v in data.items() if not str(k).startswith("__")}

    GPTConfig(**plain(model.get("gpt")))
    optimizer = plain(model.get("optimizer"))
    if "betas" in optimizer:
        optimizer["betas"] = tuple(optimizer["betas"])
    OptimizerConfig(**optimizer)
    ScheduleConfig(**plain(model.get("schedule")))


def _runs_on_cpu(trainer_cfg: Any) -> bool:
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator == "cpu":
        return True
    if accelerator in ("auto", "gpu", "cuda"):
        import torch

        return not torch.cuda.is_available()
    return False


def check_config_files(argv: list[str]) -> None:
    """Read every ``--config`` file first, so an empty or malformed one is named in the error
    (the parser itself reports them as "Unexpected config" or ``<unicode string>``)."""
    import yaml

    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            continue  # not a file: the parser reports it (or takes it as inline YAML)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise RunConfigError(f"config file {path}: cannot be read ({err})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise RunConfigError(
                f"config file {path}: YAML error{where}: {problem}; fix the file's syntax"
            ) from None
        if data is None:
            raise RunConfigError(
                f"config file {path} is empty; give it settings (e.g. `trainer: {{max_steps: "
                f"100}}`) or leave out --config {raw}"
            )
        if not isinstance(data, dict):
            raise RunConfigError(
                f"config file {path} must be a mapping of settings (e.g. `trainer: ...`), "
                f"got a {type(data).__name__}"
            )


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
    """LightningCLI for nanolab: ``run`` settings, derived accumulation, run directories.

    Args:
        verb: The subcommand being run (``fit``, ``validate``, ``test``): only its parser is
            built. LightningCLI builds one per subcommand, four in all, and a run uses one
            (the other three cost 0.15 s of CPU at every launch; docs/performance.md).
    """

    def __init__(self, *args: Any, verb: str | None = None, **kwargs: Any) -> None:
        self._verb = verb
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        every = LightningCLI.subcommands()
        verb = getattr(self, "_verb", None)
        return {verb: every[verb]} if verb in every else every

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
        # On by default: K non-finite steps in a row stop the run (exit 3, reason "diverged").
        from nanolab.callbacks.divergence import DivergenceStop

        parser.add_lightning_class_args(DivergenceStop, "divergence")
        parser.link_arguments("run.fresh", "log.fresh")
        # On by default: SIGTERM/SIGINT/SIGUSR1 -> finish the step, checkpoint, exit 75.
        # Registered last: its step-end hook must run after the other callbacks have counted
        # the step (log record, token clock), so the checkpoint it saves includes that step.
        from nanolab.callbacks.preemption import PreemptionHandler

        parser.add_lightning_class_args(PreemptionHandler, "preemption")
        # A tracker fed from the run log, its files inside the run directory (docs/loggers.md).
        parser.add_argument(
            "--logger",
            type=Literal["tensorboard", "csv", "wandb", "mlflow"] | None,
            default=None,
            help="Experiment logger writing into the run directory, at metrics.jsonl's steps.",
        )

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
        check_run_name(run.name)
        run_dir = Path(run.root) / run.name
        cfg.trainer.default_root_dir = str(run_dir)
        check_max_steps(cfg.trainer.get("max_steps"))
        check_model_settings(cfg.model)
        if cfg.model.get("init_from"):  # the architecture of a Hugging Face GPT-2 (docs/hf.md)
            from nanolab.model.hf import apply_init_from

            apply_init_from(cfg.model)
        if self.subcommand == "fit" and not cfg.get("preemption", {}).get("enabled", True):
            from nanolab.training import early_signals

            early_signals.uninstall()  # preemption off: signals act as they did before

        # The vocabulary comes from the prepared data unless the config fixes it.
        data = TokenDataModule(**{k: v for k, v in cfg.data.items() if k != "__path__"})
        try:
            vocab = data.vocab_size  # prepares the dataset from data.source when needed
        except PrepareError as err:
            from nanolab.data.checks import DataCheckError

            if "--force" not in str(err) or isinstance(err, DataCheckError):
                raise  # a damaged dataset names its own fix
            # prepare's "already holds another dataset ... pass --force": fit has no --force.
            raise RunConfigError(
                f"data.dataset_dir {data.dataset_dir} already holds a dataset prepared from other "
                "sources or settings than data.source/data.tokenizer, and fit never overwrites "
                f"one: train on it as it is with --data.source null, choose another "
                f"--data.dataset_dir, or replace it with `nanolab prepare <sources> -o "
                f"{data.dataset_dir} --force`"
            ) from None
        if cfg.model.get("init_from"):  # the data must be tokenized as the checkpoint's was
            from nanolab.model.hf_tokenizer import check_init_from_data

            check_init_from_data(cfg.model, data)
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
        if _runs_on_cpu(cfg.trainer):
            # Say it now, from the estimator, rather than swapping or being OOM-killed later.
            from nanolab.training.autobatch import check_fits_on_host

            nodes = int(cfg.trainer.get("num_nodes") or 1)
            check_fits_on_host(cfg.as_dict(), processes=max(1, world // max(1, nodes)))
        # The training stream is endless (steps, not epochs): validation is counted in
        # micro-batches, so one optimizer step = `accumulate` of them.
        cfg.trainer.val_check_interval = run.eval_every_steps * accumulate
        cfg.trainer.check_val_every_n_epoch = None
        self.run_config = run
        self.run_dir = run_dir
        if cfg.get("logger"):
            self._check_logger(cfg)
        apply_float32_matmul_precision(run.float32_matmul_precision, cfg.trainer)
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

    def _parse_ckpt_path(self) -> None:
        """Check a ``--ckpt_path`` file the safe way before LightningCLI opens it (it reads the
        checkpoint's hyperparameters right after parsing): a bad file is one error line."""
        sub = self.config.get("subcommand")
        given = self.config[sub].get("ckpt_path") if sub else None
        if given is not None and Path(str(given)).is_file():
            from nanolab.training.resume import ResumeError, resume_candidate

            try:
                resume_candidate(str(given), ".", None, "--ckpt_path", training=sub == "fit")
            except ResumeError as err:
                raise RunConfigError(str(err)) from None
        super()._parse_ckpt_path()

    def _check_logger(self, cfg: Any) -> None:
        """``--logger``: one line with the pip command when its package is missing."""
        from nanolab.callbacks.loggers import LoggerUnavailableError, check_available

        if cfg.trainer.get("logger") not in (None, False):
            raise RunConfigError(
                "--logger and --trainer.logger both set a logger; give one of them"
            )
        try:
            check_available(cfg.logger)
        except LoggerUnavailableError as err:
            raise RunConfigError(str(err)) from None

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        if self.subcommand in ("validate", "test"):
            # Evaluating a run's checkpoint must not rewrite that run's config.yaml.
            self.save_config_callback = None
        elif self.subcommand == "fit":
            from nanolab.callbacks.loggers import make_logger, run_dir_save_config

            self.save_config_callback = run_dir_save_config()  # config.yaml in the run dir
            name = self.config["fit"].get("logger")
            if name:
                kwargs["logger"] = make_logger(name, self.run_dir, str(self.run_config.name))
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        from nanolab.training import early_signals

        early_signals.stop_if_received()  # a scheduler's signal during start-up: exit 75 now
        kwargs = self.config_init["fit"]
        kwargs["weights_only"] = True
        run = self.run_config
        # One launch per run directory: taken before anything in it is read or written.
        from nanolab.callbacks.runlock import acquire

        try:
            acquire(self.run_dir)
        except OSError as err:
            raise RunConfigError(
                f"run directory {self.run_dir} cannot be used ({err.strerror or err}); set "
                "run.root to a folder this user can write"
            ) from None
        # The newest *complete* checkpoint for auto (a torn one is reported and skipped), or the
        # one given, opened without running its pickle and checked against this model.
        requested, flag = self._requested_checkpoint(kwargs.get("ckpt_path"))
        cand = None
        if requested is not None and not (run.fresh and requested == "auto"):
            cand = self._checkpoint(requested, flag, training=True)
        kwargs["ckpt_path"] = str(cand.path) if cand is not None else None
        # Refuse to resume on data that changed under the run (file sizes, meta.json) before
        # anything is written; the DataModule checks again when the trainer restores it.
        check_data = getattr(self.datamodule, "check_resume", None)
        if callable(check_data):
            check_data(kwargs.get("ckpt_path"))
        # Refuse a directory holding a different run (or a foreign checkpoint into it) before
        # anything (config.yaml) is written.
        from nanolab.callbacks.rundir import claim_run_dir

        claim_run_dir(
            self.run_dir,
            self.config[self.subcommand].as_dict(),
            resuming=cand is not None,
            fresh=run.fresh,
            checkpoint=cand.path if cand is not None else None,
            checkpoint_run_id=cand.run_id if cand is not None else None,
        )

    def _requested_checkpoint(self, ckpt_path: Any) -> tuple[str | None, str]:
        """What to resume from: ``--ckpt_path`` or ``run.resume`` (auto/never/a path), and the
        name of the setting that asked for it (for messages)."""
        resume = str(self.run_config.resume)
        if ckpt_path is None:
            return (None if resume == "never" else resume), "run.resume"
        given = str(ckpt_path)
        if given in ("last", "hpc"):
            return "auto", "--ckpt_path"  # Lightning's names for "this run's newest"
        if given in ("best", "registry") or given.startswith("registry:"):
            raise RunConfigError(
                f"--ckpt_path {given}: not supported by nanolab fit; give a checkpoint file, "
                "or use run.resume auto to continue this run"
            )
        if resume not in ("auto", "never") and Path(resume) != Path(given):
            raise RunConfigError(
                f"--ckpt_path {given} and run.resume {resume} name different checkpoints; "
                "give one of them"
            )
        return given, "--ckpt_path"

    def _checkpoint(self, requested: str, flag: str, training: bool) -> Any:
        """Open the checkpoint without running its pickle and check it fits this model: a bad
        file is one error line (exit 2), never a traceback from deep inside Lightning."""
        from dataclasses import asdict

        from nanolab.training.resume import ResumeError, check_same_shapes, resume_candidate

        gpt = getattr(self.model, "gpt_config", None)
        try:
            cand = resume_candidate(
                requested, self.run_dir, asdict(gpt) if gpt else None, flag, training
            )
            if cand is not None and getattr(self.model, "model", None) is not None:
                expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
                check_same_shapes(cand, expected, flag)
        except ResumeError as err:
            raise RunConfigError(str(err)) from None
        return cand

    def _before_evaluation(self, verb: str) -> None:
        """Pick the checkpoint (docs/evaluate.md): the run's newest by default, never an
        untrained model unless ``--ckpt_path none``; hold the run directory when the result
        will be appended to its run log."""
        from nanolab.training.evaluate import EvaluateError, resolve

        kwargs = self.config_init[verb]
        kwargs["weights_only"] = True  # a checkpoint is data, not code
        try:
            target = resolve(
                kwargs.get("ckpt_path"),
                self.run_dir,
                verb,
                has_init_from=bool(self.config[verb].model.get("init_from")),
            )
        except EvaluateError as err:
            raise RunConfigError(str(err)) from None
        self.eval_target = target
        if target.path is None:
            kwargs["ckpt_path"] = None
            return
        cand = self._checkpoint(str(target.path), "--ckpt_path", training=False)
        kwargs["ckpt_path"] = str(cand.path)
        if target.log_to_run:
            from nanolab.callbacks.runlock import RunLockedError, acquire

            try:
                acquire(self.run_dir)  # no fit may append or rotate while the record is written
            except (RunLockedError, OSError) as err:
                target.log_to_run = False
                rank_zero_warn(f"not logging this {verb} to {self.run_dir}: {err}")

    def _after_evaluation(self, verb: str, stage: str) -> None:
        """Append the result to the run log when the run's own checkpoint was evaluated."""
        target = getattr(self, "eval_target", None)
        if target is None or not target.log_to_run or not self.trainer.is_global_zero:
            return
        from nanolab.callbacks.jsonl import to_floats
        from nanolab.training.evaluate import append_record, eval_record

        metrics = to_floats(dict(self.trainer.callback_metrics))
        path = append_record(self.run_dir, eval_record(verb, stage, metrics, target))
        rank_zero_info(f"{stage} record (step {target.step}) appended to {path}")

    def before_validate(self) -> None:
        self._before_evaluation("validate")

    def after_validate(self) -> None:
        self._after_evaluation("validate", "val")

    def before_test(self) -> None:
        self._before_evaluation("test")

    def after_test(self) -> None:
        self._after_evaluation("test", "test")


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
    CallbackConfigError,  # includes RunDirError and RunLockedError: a run directory in use
    HostMemoryError,  # a CPU run that cannot fit in this machine's memory
    CheckpointWriteError,  # a full disk: older checkpoints are intact, the message says so
)


def run_lightning_cli(argv: list[str]) -> int:
    """Run ``fit``/``validate``/``test``; a bad value ends in one error line and exit code 2.

    Exit codes (docs/guarantees.md): 0 done (also stopped by a budget), 2 bad input or a run
    directory in use, 3 diverged, 75 preempted (rerun the same command to resume).
    """
    from nanolab.callbacks.runlock import release_all

    try:
        check_config_files(argv)
        cli = NanolabCLI(
            GPTLightningModule,
            TokenDataModule,
            # args=None lets LightningCLI read sys.argv itself (it warns when given both).
            args=None if argv == sys.argv[1:] else argv,
            trainer_defaults=trainer_defaults(),
            save_config_kwargs={"overwrite": True},
            seed_everything_default=1337,
            auto_configure_optimizers=False,
            parser_class=OneLineErrorParser,
            verb=argv[0] if argv else None,
        )
    except USER_ERRORS as err:
        print(f"nanolab {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    finally:
        release_all()
    from nanolab.callbacks.divergence import EXIT_DIVERGED, diverged

    stopped = diverged(getattr(cli, "trainer", None))
    if stopped is not None:
        trainer = cli.trainer
        if trainer.is_global_zero:
            last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
            kept = f"newest finite checkpoint: {last}" if last.exists() else "no checkpoint saved"
            print(
                f"nanolab {argv[0]}: diverged: {stopped.describe()}; stopped at step "
                f"{trainer.global_step} ({kept}); lower model.optimizer.lr or raise "
                "model.schedule.warmup_steps",
                file=sys.stderr,
            )
        return EXIT_DIVERGED
    return 0
