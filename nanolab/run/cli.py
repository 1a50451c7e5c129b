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
from nanolab.data.prepare import PrepareError
from nanolab.errors import NanolabError
from nanolab.estimator.gpus import MatmulPrecision
from nanolab.run.autobatch import (
    AutoBatchError,
    device_memory_bytes,
    plan_memory,
)
from nanolab.training.plugins import (
    DEFAULT_DATA,
    DEFAULT_MODEL,
    PluginImportError,
    check_importable,
    class_paths_in_argv,
    class_paths_in_config,
)
from nanolab.training.resolve import (  # noqa: F401  (gradient_accumulation: a public name here)
    FIT_SEED,
    RunConfigError,
    check_model_settings,
    gradient_accumulation,
    plain_config,
    resolve,
    trainer_defaults,
    visible_gpus,
)


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
    float32_matmul_precision: MatmulPrecision = "high"


def apply_float32_matmul_precision(value: str, trainer_cfg: Any) -> None:
    """Set the FP32 matmul precision for a GPU run (a CPU run keeps torch's default)."""
    if str(trainer_cfg.get("accelerator", "auto")) == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(value)


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


def _data_vocab(data: Any) -> int | None:
    """The data's vocabulary (preparing the dataset from ``data.source`` when needed); None
    for a DataModule that has none (the model's config must then fix it)."""
    try:
        vocab = data.vocab_size
    except AttributeError:
        return None
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
    return None if vocab is None else int(vocab)


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
    (the parser itself reports them as "Unexpected config" or ``<unicode string>``), and import
    the model, data and callback classes they and the command line name, so a plug-in that
    does not import is one line naming its module (the parser would say it "does not validate
    against any of the Union subtypes")."""
    import yaml

    plugins = class_paths_in_argv(argv)
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
        plugins += class_paths_in_config(data)
    try:
        check_importable(plugins)
    except PluginImportError as err:
        raise RunConfigError(str(err)) from None


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad config in one line (the key and what is wrong), not a usage screen."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        message = subclass_problem(str(message)) or str(message)
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        summary = " ".join(lines[:3])
        sys.stderr.write(f"nanolab: error: {summary}\n")
        sys.exit(2)


def _unwrap_union_error(err: BaseException) -> BaseException:
    """The exception a class raised, from under jsonargparse's Union report (its cause)."""
    while (
        isinstance(err, ValueError)
        and "Does not validate against any of the Union subtypes" in str(err)
        and isinstance(err.__cause__, Exception)
    ):
        err = err.__cause__
    return err


def subclass_problem(message: str) -> str | None:
    """The setting at fault inside a ``model``/``data`` class choice, with its full key.

    The parser reports a bad ``model.gpt.n_layer`` as "Parser key "model": Does not validate
    against any of the Union subtypes ... Problem with given class_path X: Parser key
    "gpt.n_layer": Expected a <class 'int'>": this keeps the inner problem, keyed from the top.
    """
    import re

    head = re.match(r'Parser key "([\w.]+)":', message)
    start = message.find("Problem with given class_path")
    if head is None or start < 0:
        return None
    group = head.group(1)
    lines = message[start:].splitlines()
    inner = []
    for line in lines[1:]:
        text = line.strip()
        if text.startswith("- Expected a <class 'NoneType'>") or text.startswith("Given value"):
            break
        inner.append(text)
    text = " ".join(inner).strip()
    text = re.sub(r'Parser key "([^"]+)"', lambda m: f'Parser key "{group}.{m.group(1)}"', text)
    text = re.sub(r"--(?!config)([\w.]+)=", lambda m: f"--{group}.{m.group(1)}=", text)
    text = re.sub(r"Group '([\w.]+)'", lambda m: f"Group '{group}.{m.group(1)}'", text)
    return text or None


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
        # Model and data are choices (--model pkg.mod.Class); nanolab's own by default. The
        # data's block_size follows the model's gpt.block_size (set by the resolver).
        parser.set_defaults(
            {"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}}
        )
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
        # On by default: K non-finite steps in a row, or a collapsed fp16 loss scale, stop the run.
        from nanolab.callbacks.divergence import DivergenceStop

        parser.add_lightning_class_args(DivergenceStop, "divergence")
        parser.link_arguments("run.fresh", "log.fresh")
        # On by default: SIGTERM/SIGINT/SIGUSR1 -> finish the step, checkpoint, exit 75.
        # Its step hooks run after the run log's and the stop checks' wherever it is registered
        # (StepCallback.step_order), so the checkpoint it saves includes the step's record.
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
        model_args = cfg.model.init_args
        check_model_settings(model_args.as_dict())
        if model_args.get("init_from"):  # the architecture of a Hugging Face GPT-2 (docs/hf.md)
            from nanolab.model.hf import apply_init_from

            apply_init_from(model_args)
        visible = visible_gpus(cfg.trainer.get("accelerator"))
        # Every setting that needs neither the data nor the device, checked before either.
        resolve(cfg, visible_gpus=visible)
        if self.subcommand == "fit" and not cfg.get("preemption", {}).get("enabled", True):
            from nanolab.training import early_signals

            early_signals.uninstall()  # preemption off: signals act as they did before

        # The vocabulary comes from the data (prepared now if needed) unless the config fixes it.
        data = self._data_module(cfg.data)
        vocab = _data_vocab(data)
        if model_args.get("init_from"):  # the data must be tokenized as the checkpoint's was
            from nanolab.model.hf_tokenizer import check_init_from_data

            check_init_from_data(model_args, data)
        resolved = resolve(cfg, visible_gpus=visible, data_vocab=vocab)
        self._apply(cfg, resolved)
        micro = self._plan_micro_batch(cfg, resolved)
        if micro != resolved.micro_batch_size:
            resolved = resolve(cfg, visible_gpus=visible, data_vocab=vocab, micro_batch_size=micro)
            self._apply(cfg, resolved)
        # Fail now, not after start-up, when the data cannot fill one step of every rank.
        data.block_size = resolved.block_size
        data.micro_batch_size = resolved.micro_batch_size
        check_fits = getattr(data, "check_fits", None)
        if callable(check_fits):
            check_fits(resolved.world_size)
        if _runs_on_cpu(cfg.trainer):
            # Say it now, from the estimator, rather than swapping or being OOM-killed later.
            from nanolab.run.autobatch import check_fits_on_host

            check_fits_on_host(
                plain_config(cfg), processes=max(1, resolved.world_size // resolved.num_nodes)
            )
        cfg.trainer.check_val_every_n_epoch = None
        self.run_config = run
        self.run_dir = resolved.run_dir
        if cfg.get("logger"):
            self._check_logger(cfg)
        apply_float32_matmul_precision(run.float32_matmul_precision, cfg.trainer)
        from nanolab.callbacks.progress import reconcile_progress_bar

        reconcile_progress_bar(cfg)

    @staticmethod
    def _data_module(data_cfg: Any) -> Any:
        """The configured DataModule, built once here to read what the run derives from it."""
        from nanolab.training.plugins import PluginImportError, load_class

        try:
            cls = load_class(data_cfg.class_path, "data")
        except PluginImportError as err:
            raise RunConfigError(str(err)) from None
        args = {
            key: value.as_dict() if hasattr(value, "as_dict") else value
            for key, value in vars(data_cfg.init_args).items()
            if not key.startswith("__")
        }  # top-level arguments (items() would flatten nested ones into dotted keys)
        return cls(**args)

    @staticmethod
    def _apply(cfg: Any, resolved: Any) -> None:
        """Write the derived values into the config that is instantiated and saved."""
        gpt = cfg.model.init_args.get("gpt")
        if gpt is not None:
            gpt.vocab_size = resolved.vocab_size
        data_args = cfg.data.init_args
        if "block_size" in data_args:
            data_args.block_size = resolved.block_size
        if resolved.micro_batch_size is not None and "micro_batch_size" in data_args:
            data_args.micro_batch_size = resolved.micro_batch_size
        cfg.trainer.default_root_dir = str(resolved.run_dir)
        if resolved.accumulate is not None:
            cfg.trainer.accumulate_grad_batches = resolved.accumulate
            # The training stream is endless (steps, not epochs): validation is counted in
            # micro-batches, so one optimizer step = `accumulate` of them.
            cfg.trainer.val_check_interval = resolved.val_check_interval

    def _plan_micro_batch(self, cfg: Any, resolved: Any) -> int:
        """The micro-batch: the resolved one, or for ``auto`` the largest the estimator says
        fits this GPU (the data's value on a CPU); on a GPU, warn when it will not fit."""
        choice = cfg.run.micro_batch_size
        micro = resolved.micro_batch_size
        if micro is None:  # auto: planned below, the data's value where there is no GPU
            micro = int(cfg.data.init_args.get("micro_batch_size") or 1)
        device_memory = (
            device_memory_bytes() if str(cfg.trainer.get("accelerator")) != "cpu" else None
        )
        if device_memory is None:
            return micro  # CPU: no device memory to plan against
        try:
            config = plain_config(cfg)
            section = config["data"].get("init_args", config["data"])
            section["micro_batch_size"] = micro
            plan = plan_memory(config, device_memory, choice == "auto", resolved.devices_per_node)
        except ValueError as err:  # the estimator cannot describe this config: say so, go on
            if isinstance(err, AutoBatchError):
                raise RunConfigError(str(err)) from None
            rank_zero_warn(f"memory estimate unavailable: {err}")
            return micro
        if choice == "auto":
            micro = plan.micro_batch_size
            rank_zero_info(
                f"run.micro_batch_size auto: {plan.micro_batch_size} (predicted peak "
                f"{plan.predicted_bytes / 2**30:.1f} of {plan.device_bytes / 2**30:.1f} GiB)"
            )
        if plan.warning:
            rank_zero_warn(plan.warning)
        return micro

    def instantiate_classes(self) -> None:
        """Build model, data and trainer; an error a class raises while being built (a bad
        ``model.init_from``, ``model.freeze``) comes out as itself, one line, instead of inside
        the parser's "does not validate against any of the Union subtypes" report."""
        try:
            super().instantiate_classes()
        except ValueError as err:
            raise _unwrap_union_error(err) from None

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
            plain_config(self.config[self.subcommand]),
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
        from nanolab.training.evaluate import EvaluateError, eval_target

        kwargs = self.config_init[verb]
        kwargs["weights_only"] = True  # a checkpoint is data, not code
        try:
            target = eval_target(
                kwargs.get("ckpt_path"),
                self.run_dir,
                verb,
                has_init_from=bool(self.config[verb].model.init_args.get("init_from")),
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


def model_and_data_classes() -> dict[str, Any]:
    """LightningCLI arguments that make ``model`` and ``data`` choices of any LightningModule /
    LightningDataModule (subclass mode); :class:`NanolabCLI` defaults them to nanolab's own."""
    from lightning.pytorch import LightningDataModule, LightningModule

    return {
        "model_class": LightningModule,
        "datamodule_class": LightningDataModule,
        "subclass_mode_model": True,
        "subclass_mode_data": True,
    }


#: What ends `fit` as one error line and exit 2: every error a user can fix, and a full disk
#: (older checkpoints are intact, the message says so).
USER_ERRORS = (NanolabError, CheckpointWriteError)


NULL_WORDS = ("null", "Null", "NULL", "~")


def nulls_as_class_settings(argv: list[str]) -> list[str]:
    """``--model.gpt.vocab_size null`` rewritten as ``--model '{"init_args": {...: null}}'``.

    With ``model``/``data`` as class choices, jsonargparse (4.53) hands a nested ``null`` to the
    class's parser as the string ``"None"``, so every ``Optional`` setting refused ``null`` on the
    command line. The same setting given as an ``init_args`` dict merges into the chosen class
    and keeps everything given before and after it.
    """
    import json

    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, value, width = None, None, 1
        for group in ("--model.", "--data."):
            if arg.startswith(group) and not arg.startswith(group + "class_path"):
                if "=" in arg:
                    key, value = arg.split("=", 1)
                elif i + 1 < len(argv):
                    key, value, width = arg, argv[i + 1], 2
                break
        if key is None or value not in NULL_WORDS:
            out.append(arg)
            i += 1
            continue
        group, *path = key[2:].split(".")
        if path and path[0] == "init_args":
            path = path[1:]
        nested: object = None
        for part in reversed(path):
            nested = {part: nested}
        out += [f"--{group}", json.dumps({"init_args": nested})]
        i += width
    return out


class FitParseError(RunConfigError):
    """``fit``'s parser refused a command line; the message is its one error line."""


def parse_fit_config(args: list[str]) -> Any:
    """The merged config ``nanolab fit ARGS`` would run, read by the fit parser itself.

    Nothing is built and this process's RNG is not touched: parsing stops at LightningCLI's
    ``before_instantiate_classes`` hook. ``queue add`` checks jobs with it and the resolver's
    parity test holds :func:`nanolab.training.resolve.compose` against it. Raises
    :class:`FitParseError` with the parser's error line.
    """
    import contextlib
    import io
    import warnings

    class Parsed(Exception):
        pass

    class ParseOnly(NanolabCLI):
        def _set_seed(self) -> None:  # parsing must not touch this process's RNG
            pass

        def before_instantiate_classes(self) -> None:
            raise Parsed(self.config["fit"])

    argv = nulls_as_class_settings(["fit", *args])
    try:
        check_config_files(argv)  # unreadable YAML, a model/data class that does not import
    except RunConfigError as err:
        raise FitParseError(str(err)) from None
    err = io.StringIO()
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            ParseOnly(
                **model_and_data_classes(),
                args=argv,
                trainer_defaults=trainer_defaults(),
                seed_everything_default=FIT_SEED,
                auto_configure_optimizers=False,
                parser_class=OneLineErrorParser,
                run=True,
            )
    except Parsed as parsed:
        return parsed.args[0]
    except SystemExit:
        raise FitParseError(_parser_error_line(err.getvalue())) from None
    raise FitParseError("could not be parsed")  # pragma: no cover - one of the two above


def _parser_error_line(text: str) -> str:
    """The parser's message without its usage screen: the last line that says 'error'."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if "error:" in lines[i]:
            msg = lines[i].split("error:", 1)[1].strip()
            return " ".join([msg, *lines[i + 1 : i + 3]]).strip()
    return lines[-1] if lines else "the config does not parse"


def run_lightning_cli(argv: list[str]) -> int:
    """Run ``fit``/``validate``/``test``; a bad value ends in one error line and exit code 2.

    Exit codes (docs/guarantees.md): 0 done (also stopped by a budget), 2 bad input or a run
    directory in use, 3 diverged, 75 preempted (rerun the same command to resume).
    """
    from nanolab.callbacks.runlock import release_all
    from nanolab.run.quiet import quiet_lightning

    quiet_lightning(argv[0] if argv else None)  # start-up chatter; the banner says what matters
    from nanolab.run import short_help

    if short_help.wants_short_help(argv):  # one page; Lightning's ~900 lines: --help-all
        print(short_help.short_help(argv[0]))
        return 0
    from_command_line = argv == sys.argv[1:]
    argv = nulls_as_class_settings(short_help.full_help_argv(argv))
    if from_command_line:
        sys.argv[1:] = argv  # LightningCLI reads them there (it warns when given both)
    try:
        check_config_files(argv)
        cli = NanolabCLI(
            **model_and_data_classes(),
            # args=None lets LightningCLI read sys.argv itself (it warns when given both).
            args=None if from_command_line else argv,
            trainer_defaults=trainer_defaults(),
            save_config_kwargs={"overwrite": True},
            seed_everything_default=FIT_SEED,
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
            hint = stopped.hint()
            print(
                f"nanolab {argv[0]}: diverged: {stopped.describe()}; stopped at step "
                f"{trainer.global_step} ({kept})" + (f"; {hint}" if hint else ""),
                file=sys.stderr,
            )
        return EXIT_DIVERGED
    return 0
