"""How a run is assembled: :func:`launch` is the whole of ``nanolab fit / validate / test``.

Read :func:`launch` top to bottom to see a fit put together: parse (``nanolab.run.parse``) →
seed → resolve the derived values (``nanolab.training.resolve``) → build the data, the model,
the run's callbacks, the logger and the Trainer → hold the run directory and pick the
checkpoint → ``trainer.fit``. The helpers below it each do one of those steps.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from nanolab.callbacks.budget import CostBudget
from nanolab.callbacks.checkpoint import (
    RotatingCheckpoint,
    rolled_back_problem,
    step_of,
)
from nanolab.callbacks.clock import RunClock
from nanolab.callbacks.events import NothingToTrain
from nanolab.callbacks.jsonl import MetricsLog
from nanolab.callbacks.loggers import RunConfigWriter
from nanolab.callbacks.rank_watch import watching
from nanolab.callbacks.rundir import CHECKPOINT_DIR
from nanolab.callbacks.runlock import global_rank_from_env
from nanolab.data.prepare import BadTextError, OutputInUseError
from nanolab.messages import warn
from nanolab.run.autobatch import AutoBatchError, gpu_memories, plan_memory
from nanolab.run.parse import NanolabCLI, run_callbacks, unwrap_union_error
from nanolab.run.trainer_errors import REFUSALS, refuse_missing_gpu, trainer_refusal
from nanolab.run.validation_set import partial_validation_warning
from nanolab.runlog import RUN_LOG_NAME
from nanolab.training.branch import BRANCH_KEEPS, branch_command
from nanolab.training.masked_targets import masked_targets_problem
from nanolab.training.parallelism import parse_strategy
from nanolab.training.plugins import check_needed_methods
from nanolab.training.resolve import (
    RunConfigError,
    check_model_settings,
    check_seed,
    plain_config,
    resolve,
    visible_gpus,
)
from nanolab.training.resume import flag_value


def launch(cli: NanolabCLI) -> Trainer:
    """Build the run the parsed command line describes and run its verb; the Trainer after it.

    Every derived value (vocabulary, block size, micro-batch, accumulation, validation interval,
    run directory) is written into the config before anything is built, so ``config.yaml`` is
    the run as it ran. Each check comes before the work it protects: the model settings before
    the data is prepared, the data's size before the model is built, the run directory's lock
    and owner before anything in it is written.
    """
    verb = str(cli.subcommand)
    cfg = cli.config[verb]
    seed = cfg.get("seed_everything")
    if seed is not False:  # LightningCLI's rule: true = a random seed, recorded in config.yaml
        cfg.seed_everything = seed_everything(chosen_seed(seed), workers=True)

    # -- resolve: name the run, check what needs neither data nor device, then derive the rest
    run = cfg.run
    if run.name is None:
        given = cfg.get("config")
        run.name = default_run_name(Path(str(given[-1])).stem if given else "run")
    if verb == "fit" and not cfg.get("config") and global_rank_from_env() == 0:
        warn("nanolab fit", without_config(plain_config(cfg)))
    model_args = cfg.model.init_args
    check_model_settings(model_args.as_dict())
    if model_args.get("init_from"):  # the architecture of a Hugging Face GPT-2 (docs/hf.md)
        from nanolab.model.hf import apply_init_from

        apply_init_from(model_args)
    refuse_missing_gpu(cfg.trainer)  # before the data: a GPU recipe on a machine without one
    visible = visible_gpus(cfg.trainer.get("accelerator"))
    named = resolve(cfg, visible_gpus=visible)
    if verb == "fit" and named.run_dir is not None:  # before anything is written (the data)
        from nanolab.callbacks.rundir import refuse_nested_run_dir

        refuse_nested_run_dir(named.run_dir)
    from nanolab.training import early_signals

    if verb == "fit" and not cfg.get("preemption", {}).get("enabled", True):
        early_signals.uninstall()  # preemption off: signals act as they did before
    early_signals.defer(named.run_dir)  # from here start-up writes: a signal waits for a safe point
    data = build_data_module(cfg.data)  # once, to read the vocabulary (preparing it if asked)
    vocab = data_vocab(data, cfg.data, verb)
    if model_args.get("init_from"):  # the data must be tokenized as the checkpoint's was
        from nanolab.model.hf_tokenizer import check_init_from_data

        check_init_from_data(model_args, data)
    if verb != "fit":  # the checkpoint to score, picked before the model is sized by the data
        picked = evaluation_checkpoint(verb, cfg, named.run_dir, data)
    fill_eot_id(model_args, data)
    resolved = resolve(cfg, visible_gpus=visible, data_vocab=vocab, data_built=True)
    micro = plan_micro_batch(cfg, resolved)
    if micro != resolved.micro_batch_size:
        resolved = resolve(
            cfg, visible_gpus=visible, data_vocab=vocab, data_built=True, micro_batch_size=micro
        )
    write_derived(cfg, resolved)
    data.block_size, data.micro_batch_size = resolved.block_size, resolved.micro_batch_size
    check_fits = getattr(data, "check_fits", None)
    if verb != "fit":  # validate/test read the validation windows only, not the training split
        check_fits = getattr(data, "check_validation_fits", check_fits)
    if callable(check_fits):  # now, not after start-up: the data must fill a step of each rank
        check_fits(resolved.world_size)
    partial = partial_validation_warning(
        cfg.trainer.get("limit_val_batches"),
        cfg.data.init_args.get("val_windows"),
        int(resolved.micro_batch_size or 1),
        resolved.world_size,
        len(getattr(data, "mixture", None) or [None]),  # a mixture: windows per dataset
    )
    if partial:
        rank_zero_warn(partial)
    if runs_on_cpu(cfg.trainer):  # say it now rather than swap or be OOM-killed later
        from nanolab.run.autobatch import check_fits_on_host

        processes = max(1, resolved.world_size // resolved.num_nodes)
        check_fits_on_host(plain_config(cfg), processes=processes)
    if cfg.get("logger"):
        check_logger(cfg)
    apply_float32_matmul_precision(run.float32_matmul_precision, cfg.trainer)
    from nanolab.callbacks.progress import reconcile_progress_bar

    reconcile_progress_bar(cfg)
    run_dir = Path(resolved.run_dir)

    # -- build: model, data, the run's callbacks, the logger, the Trainer
    given_callbacks = callback_class_paths(cfg.trainer.get("callbacks"))
    try:
        instantiate = getattr(cli.parser, "instantiate", None) or cli.parser.instantiate_classes
        built = instantiate(cli.config)[verb]  # jsonargparse >= 4.49 names it instantiate
    except ValueError as err:  # a class's own error, not the parser's Union report around it
        err = unwrap_union_error(err)
        raise callback_build_error(err, given_callbacks) or err from None
    except Exception as err:  # a callback of the config that cannot be built: name it
        one_line = callback_build_error(err, given_callbacks)
        if one_line is None:
            raise
        raise one_line from None
    model, data = built.model, built.data
    check_needed_methods(verb, model, data)  # Lightning's own refusal comes after the claim
    if verb == "fit":  # recorded in every checkpoint it saves
        from nanolab.training.module import GPTLightningModule

        if isinstance(model, GPTLightningModule):
            model.class_record = launch_classes(cfg, model, data)
    trainer_args = {**built.trainer}
    callbacks = trainer_args.get("callbacks") or []
    callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
    check_lambda_callbacks(callbacks)
    if verb == "fit" and not cfg.get("logger"):
        check_logger_callbacks(callbacks, trainer_args.get("logger"))
    callbacks += [built[group] for group in run_callbacks()]
    if verb == "fit":  # config.yaml in the run dir (a fast_dev_run too: its start record needs it)
        callbacks.insert(0, RunConfigWriter(cli.verb_parser, cfg))  # first: the banner reads it
    if verb == "fit" and os.environ.get("NANOLAB_COUNT_SYNCS"):  # nanolab bench --count-syncs
        from nanolab.callbacks.syncs import ENV, sync_count_callback

        callbacks.append(sync_count_callback(os.environ[ENV]))
    if verb == "fit" and cfg.get("logger"):
        trainer_args["logger"] = False  # built once the run directory is claimed (below)
    try:
        trainer = Trainer(**{**trainer_args, "callbacks": callbacks})
    except REFUSALS as err:  # a trainer.* setting Lightning refuses: one line, nothing written
        raise trainer_refusal(err, trainer_args) from None

    # -- run: hold the run directory, pick the checkpoint (opened without running its pickle)
    strategy_kind = parse_strategy(
        plain_config(cfg)["trainer"].get("strategy"), resolved.world_size
    ).kind
    if verb == "fit":
        masked = masked_targets_problem(data, strategy_kind)
        if masked is not None:
            raise RunConfigError(masked)
        early_signals.stop_if_received()  # a scheduler's signal during start-up: exit 75 now
        claimed = claim_for_fit(
            cfg, run_dir, model, data, built.get("ckpt_path"), world_size=resolved.world_size,
            strategy_kind=strategy_kind,
        )  # fmt: skip
        cand = claimed.candidate
        ckpt_path = str(cand.path) if cand is not None else None
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, MetricsLog):  # the run log takes the id the logger does
                callback.planned_run_id = claimed.run_id
        if cfg.get("logger"):  # after the claim: a fresh start has moved the old run's folder
            from nanolab.callbacks.loggers import make_logger

            trainer.logger = make_logger(cfg.logger, run_dir, str(run.name), claimed.run_id)
        max_steps = int(trainer.max_steps or -1)
        if cand is not None and cand.step is not None and 0 < max_steps <= cand.step:
            # Nothing to train: say so and stop before the fit, which would print its banner,
            # append a start and an end record and rewrite config.yaml (the run is as it was).
            raise NothingToTrain(
                nothing_to_train(
                    cfg, run_dir, cand.step, max_steps, bool(claimed.forked), cand.path
                )
            )
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, CostBudget):  # a branch's rules decide anew
                callback.branch = bool(cand is not None and claimed.forked)
        # A new run from another's checkpoint: its data passes count from here.
        RunClock.attach(trainer).forked = bool(cand is not None and claimed.forked)
        if cand is not None and not claimed.forked:  # a branch takes its own settings
            refuse_changed_class_settings(cfg, cand, model, data, run_dir)
        if cand is not None:
            own = not claimed.forked  # a new run from another's checkpoint picks its own seeds
            if not own:  # ... and trains with its own optimizer settings and schedule
                model.branched_from = str(cand.path)
            keep_checkpoint_settings(
                cfg, cand.path, data, random_seed=seed is True, seeds=own, run_dir=run_dir
            )
            if own and hasattr(data, "keep_saved_seed"):
                data.keep_saved_seed = True  # sharded checkpoints too: the run's window order
        if claimed.older_than_newest:
            problem = rolled_back_problem(run_dir / CHECKPOINT_DIR)  # before anything trains
            if problem is not None:
                raise RunConfigError(problem)
            for callback in trainer.callbacks:  # type: ignore[attr-defined]
                if isinstance(callback, RotatingCheckpoint):  # once the resume has restored
                    callback.set_aside_after = (
                        Path(cand.path),
                        int(cand.step),
                        tuple(cand.skipped_newer),
                    )
        with watching(trainer, verb):
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
        return trainer
    target, ckpt_path = evaluation_target(verb, run_dir, model, picked, data, strategy_kind)
    evaluate = trainer.validate if verb == "validate" else trainer.test
    from nanolab.callbacks.checkpoint_io import evaluation_loads
    from nanolab.model.checkpoint import release

    try:  # nanolab prints its own plain lines (evaluation_lines), as every other verb does.
        with evaluation_loads(trainer.strategy, ckpt_path), watching(trainer, verb):
            evaluate(model, datamodule=data, ckpt_path=ckpt_path, verbose=False, weights_only=True)
    finally:
        if target.path is not None:
            release(target.path)  # the held file is restored: let a deleted one go
    if built.get("verbose", True) and trainer.is_global_zero:
        print_evaluation(trainer, verb, target, data)
    if target.log_to_run and trainer.is_global_zero:
        log_evaluation(trainer, verb, run_dir, target)
    return trainer


def print_evaluation(trainer: Trainer, verb: str, target: Any, data: Any) -> None:
    """The evaluation's metrics as plain lines on stdout; ``test`` names the windows it used."""
    from nanolab.callbacks.jsonl import to_floats
    from nanolab.training.evaluate import evaluation_lines

    kind = type(data)
    on_val = getattr(kind, "test_dataloader", None) is getattr(kind, "val_dataloader", None)
    metrics = to_floats(dict(trainer.callback_metrics))
    print("\n".join(evaluation_lines(verb, metrics, target, on_val)), flush=True)


# -- resolve ----------------------------------------------------------------------------------
#: The command a launch without ``--config`` is pointed to: the small run the README starts.
QUICKSTART_COMMAND = "nanolab fit --config configs/quickstart.yaml"


def without_config(config: dict[str, Any]) -> str:
    """The warning of ``nanolab fit`` given no ``--config``: it trains the code's defaults (a
    6 x 384 model for 5,000 steps: hours on a CPU), which a newcomer may not have meant. Said
    before anything is prepared or trained, and not refused: a launch from options alone is
    a way to run too."""
    gpt = _dotted(config, "model.gpt", None)
    model = "the default model"
    if isinstance(gpt, dict) and {"n_layer", "n_embd"} <= gpt.keys():
        model = f"a {gpt['n_layer']}-layer, {gpt['n_embd']}-wide GPT"
    steps = _dotted(config, "trainer.max_steps", None)
    length = f" for {steps:,} steps" if isinstance(steps, int) and steps > 0 else ""
    data = _dotted(config, "data.dataset_dir", None)
    where = f" on {data}" if data else ""
    return (
        f"no --config given: training the code's defaults and the options given, {model}"
        f"{length}{where}; for the small first run: {QUICKSTART_COMMAND}"
    )


def chosen_seed(seed: Any) -> int:
    """The seed for ``seed_everything``: the config's number, or for ``true`` a random one.
    Lightning's ``seed_everything(None)`` gives 0 (every "random" run the same); a random draw
    here, except in the ranks that rank 0 started (Lightning's launcher), which take rank 0's
    from ``PL_GLOBAL_SEED`` (set by its ``seed_everything`` and inherited). Ranks started
    side by side (srun, torchrun) draw their own: DDP and FSDP take rank 0's weights anyway, and
    config.yaml records rank 0's."""
    if seed is not True:
        check_seed(seed)  # null is refused: Lightning would seed 0 for every such run
        return int(seed)
    import random

    inherited = os.environ.get("PL_GLOBAL_SEED", "")
    if inherited.isdigit() and global_rank_from_env() != 0:  # a rank that rank 0 started
        return int(inherited)

    return random.SystemRandom().randrange(2**32)


def default_run_name(stem: str) -> str:
    """``<config stem>-<YYYYmmdd-HHMMSS>``, the same in every process of one launch.

    Lightning's DDP launcher re-executes the command for ranks 1..N-1 a moment later, so the
    name is handed down through ``NANOLAB_RUN_NAME``; under SLURM the job id and a digest of
    the command line after the verb are used (``<stem>-slurm<job>-<6 hex>``): the same in every
    task ``srun`` starts, after a requeue (the same command resumes its run) and for ``test``
    after ``fit`` of one config; another for each experiment of the job (two experiments of one
    job are two runs, not one resumed with the other's settings). Other multi-process launchers
    (torchrun on several nodes) should set ``run.name``.
    """
    if name := os.environ.get("NANOLAB_RUN_NAME"):
        return name
    if job := os.environ.get("SLURM_JOB_ID"):
        import hashlib

        defining = "\0".join(_run_defining_args(sys.argv[2:])).encode()
        name = f"{stem}-slurm{job}-{hashlib.sha256(defining).hexdigest()[:6]}"
    else:
        name = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.environ["NANOLAB_RUN_NAME"] = name
    return name


#: Options that say what to do with a run, not which run: ``fit``, ``validate`` and ``test`` of
#: one config (a job script that trains, then tests) name the same run.
_NOT_THE_RUN = ("--ckpt_path", "--verbose", "--run.resume", "--run.fresh")


def _run_defining_args(args: list[str]) -> list[str]:
    """The arguments after the verb, less those of :data:`_NOT_THE_RUN` (and their values)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _NOT_THE_RUN:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in _NOT_THE_RUN)):
            out.append(arg)
    return out


def build_data_module(data_cfg: Any) -> Any:
    """The configured DataModule, built once to read what the run derives from it."""
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


def data_vocab(data: Any, data_cfg: Any = None, verb: str = "fit") -> int | None:
    """The data's vocabulary (preparing the dataset from ``data.source`` when needed); None
    for a DataModule that has none (the model's config must then fix it). ``data_cfg`` (the
    ``data`` group as configured) and ``verb`` word the refusal of a stale dataset."""
    try:
        vocab = data.vocab_size
    except AttributeError:
        return None
    except OutputInUseError as err:  # the verbs have no --force: their own fix, keyed by data.*
        raise RunConfigError(
            stale_dataset_message(data, data_cfg, verb, err.holds_dataset)
        ) from None
    except BadTextError as err:  # nor --skip-bad or --text-field: what they can do instead
        raise RunConfigError(bad_text_message(data, data_cfg, verb, err)) from None
    return None if vocab is None else int(vocab)


def bad_text_message(data: Any, data_cfg: Any, verb: str, err: BadTextError) -> str:
    """Why ``verb`` stopped preparing ``data.source``, with the ``nanolab prepare`` command
    that prepares it past the bad document (:mod:`nanolab.data.bad_text`)."""
    from nanolab.data.bad_text import bad_text_message as message

    return message(
        err,
        [str(s) for s in data.source],
        data.dataset_dir,
        data.tokenizer,
        data.bpe_vocab_size,
        data.val_fraction,
        verb,
        source_is_setting=source_follows_setting(data, data_cfg),
    )


def stale_dataset_message(data: Any, data_cfg: Any, verb: str, holds_dataset: bool) -> str:
    """Why ``verb`` will not prepare ``data.source`` into ``data.dataset_dir``, and the fixes
    that work for this data class (:mod:`nanolab.data.stale`, the words ``queue add`` uses
    too): ``--data.source null`` only when the class's ``source`` is the setting's (a class
    that sets its own, like a records renderer, ignores a null)."""
    from nanolab.data import stale

    source = [str(s) for s in data.source]
    return stale.stale_dataset_message(
        data.dataset_dir,
        source,
        prepare_command(data),
        verb,
        holds_dataset,
        source_is_setting=source_follows_setting(data, data_cfg),
        theirs=stale.other_sources(data.dataset_dir, source),
    )


def source_follows_setting(data: Any, data_cfg: Any) -> bool:
    """The data module's ``source`` is the ``data.source`` setting as configured, so
    ``--data.source null`` leaves it nothing to prepare (a class that sets ``self.source``
    itself, from settings of its own, ignores the setting)."""
    init_args = getattr(data_cfg, "init_args", None)
    if init_args is None or "source" not in init_args:
        return False

    def listed(value: Any) -> list[str] | None:
        if not value:
            return None
        return [str(v) for v in ([value] if isinstance(value, (str, os.PathLike)) else value)]

    return listed(getattr(data, "source", None)) == listed(init_args.get("source"))


def prepare_command(data: Any) -> str:
    """The ``nanolab prepare`` command that prepares ``data.source`` with the data's tokenizer
    settings into its folder, replacing what is there (what fit would have prepared)."""
    from nanolab.data.stale import prepare_command as command

    source = [str(s) for s in data.source]
    return command(source, data.dataset_dir, data.tokenizer, data.bpe_vocab_size, data.val_fraction)


def fill_eot_id(model_args: Any, data: Any) -> None:
    """``model.gpt.document_mask`` with ``eot_id: null``: the end-of-text id the data's
    documents end with, written into the config the run saves."""
    gpt = model_args.get("gpt")
    if gpt is None or not gpt.get("document_mask") or gpt.get("eot_id") is not None:
        return
    eot = getattr(data, "eot_id", None)
    if eot is None:
        raise RunConfigError(
            "model.gpt.document_mask needs the end-of-text id between documents, and the data "
            "records none; prepare the data again with this nanolab, or set model.gpt.eot_id"
        )
    gpt.eot_id = int(eot)


def plan_micro_batch(cfg: Any, resolved: Any) -> int:
    """The micro-batch: the resolved one, or for ``auto`` the largest the estimator says fits
    the smallest GPU the run uses (the data's value on a CPU); on a GPU, warn when it will not
    fit."""
    choice = cfg.run.micro_batch_size
    micro = resolved.micro_batch_size
    if micro is None:  # auto: planned below, the data's value where there is no GPU
        micro = int(cfg.data.init_args.get("micro_batch_size") or 1)
    memories = []  # each GPU's the run uses: the smallest is planned on
    if str(cfg.trainer.get("accelerator")) != "cpu":
        memories = gpu_memories(cfg.trainer.get("devices"))
    device_memory = min(memories, default=None)
    if device_memory is None:  # CPU: no device memory to plan against
        if choice == "auto":
            rank_zero_info(
                f"run.micro_batch_size auto: {micro}, data.micro_batch_size (no GPU memory to "
                "plan against)"
            )
        return micro
    try:
        config = plain_config(cfg)
        section = config["data"].get("init_args", config["data"])
        section["micro_batch_size"] = micro
        plan = plan_memory(
            config,
            device_memory,
            choice == "auto",
            resolved.devices_per_node,
            gpus_differ=len(set(memories)) > 1,
        )
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


def write_derived(cfg: Any, resolved: Any) -> None:
    """Write the derived values into the config that is built and saved."""
    gpt = cfg.model.init_args.get("gpt")
    if gpt is not None:
        gpt.vocab_size = resolved.vocab_size
    data_args = cfg.data.init_args
    if "block_size" in data_args:
        data_args.block_size = resolved.block_size
    if resolved.micro_batch_size is not None and "micro_batch_size" in data_args:
        data_args.micro_batch_size = resolved.micro_batch_size
    cfg.trainer.default_root_dir = str(resolved.run_dir)
    cfg.trainer.check_val_every_n_epoch = None  # steps, not epochs: validation by interval
    if resolved.accumulate is not None:
        for key, derived, source in (
            ("accumulate_grad_batches", resolved.accumulate, "run.global_batch_tokens"),
            ("val_check_interval", resolved.val_check_interval, "run.eval_every_steps"),
        ):
            given = cfg.trainer.get(key)
            default = None if key == "val_check_interval" else 1  # Lightning's defaults
            derives = key == "val_check_interval" or resolved.global_batch_tokens is not None
            replaced = given not in (default, derived) and derives
            if replaced and global_rank_from_env() == 0:
                warn(  # a config.yaml of a run with another micro-batch gets here too
                    "nanolab fit",
                    f"trainer.{key} {given} is replaced by {derived}, derived from {source}; "
                    f"to choose it yourself set run.global_batch_tokens: null"
                    if key == "accumulate_grad_batches"
                    else f"trainer.{key} {given} is replaced by {derived} micro-batches, derived "
                    f"from {source}: set that instead",
                )
        cfg.trainer.accumulate_grad_batches = resolved.accumulate
        # The training stream is endless (steps, not epochs): validation is counted in
        # micro-batches, so one optimizer step = `accumulate` of them.
        cfg.trainer.val_check_interval = resolved.val_check_interval


def runs_on_cpu(trainer_cfg: Any) -> bool:
    """Whether the Trainer will run on this host's CPU (``auto`` without a visible GPU)."""
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator == "cpu":
        return True
    if accelerator in ("auto", "gpu", "cuda"):
        import torch

        return not torch.cuda.is_available()
    return False


def check_logger(cfg: Any) -> None:
    """``--logger``: one line with the pip command when its package is missing."""
    from nanolab.callbacks.loggers import LoggerUnavailableError, check_available

    if cfg.trainer.get("logger") not in (None, False):
        raise RunConfigError("--logger and --trainer.logger both set a logger; give one of them")
    try:
        check_available(cfg.logger)
    except LoggerUnavailableError as err:
        raise RunConfigError(str(err)) from None


def apply_float32_matmul_precision(value: str, trainer_cfg: Any) -> None:
    """Set the FP32 matmul precision for a GPU run (a CPU run keeps torch's default)."""
    if str(trainer_cfg.get("accelerator", "auto")) == "cpu":
        return
    import torch

    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(value)


# -- run: the run directory and the checkpoint ------------------------------------------------
def claim_for_fit(
    cfg: Any,
    run_dir: Path,
    model: Any,
    data: Any,
    ckpt_path: Any,
    world_size: int = 1,
    strategy_kind: str = "single",
) -> Any:
    """Take the run directory for this launch and return the checkpoint to resume from (its
    path and step), or None for a fresh start.

    The lock comes before anything in the directory is read or written; the checkpoint is the
    newest *complete* one for ``auto`` (a torn one is reported and skipped) or the one given,
    checked against this model and data; a directory holding a different run is refused
    before ``config.yaml`` is written.
    """
    from nanolab.callbacks.rundir import (
        LOGGER_DIRS,
        checkpoint_files,
        claim_run_dir,
        new_run_id,
        owner_of_log,
    )
    from nanolab.callbacks.runlock import acquire, global_rank_from_env

    run = cfg.run
    try:
        acquire(run_dir)
    except OSError as err:
        from nanolab.errors import disk_full, room_left, with_errno_of

        if disk_full(err):  # no bytes or no file entries left: exit 74, as every full disk
            left, fix = room_left(run_dir, err)
            full = RunConfigError(
                f"run directory {run_dir} cannot be used ({left}); {fix}, then rerun the same "
                "command (the run's files are intact)"
            )
            raise with_errno_of(full, err) from None
        raise RunConfigError(
            f"run directory {run_dir} cannot be used ({err.strerror or err}); set "
            "run.root to a folder this user can write"
        ) from None
    from nanolab.callbacks.spike import check_ledger, complete_rollback

    folder = run_dir / "checkpoints"
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise RunConfigError(
            f"{folder} is not a folder (a file or a broken link is in the place of the run's "
            "checkpoints); move it away, put the checkpoints folder back if you have it, and "
            "rerun the same command"
        )
    requested, flag = requested_checkpoint(str(run.resume), ckpt_path)
    log_name = str(cfg.get("log", {}).get("filename") or RUN_LOG_NAME)
    if requested not in (None, "auto") and not run.fresh:
        requested = continue_own_fork(run_dir, requested, log_name)
    if requested == "auto" and not run.fresh and global_rank_from_env() == 0:
        complete_rollback(run_dir)  # a rollback stopped half-way finishes before the choice
    if not run.fresh:
        check_ledger(run_dir)  # the data skipped after a spike is part of the run's order
    cand = None
    if requested is not None and not (run.fresh and requested == "auto"):
        cand = open_checkpoint(requested, flag, run_dir, model, training=True, data=data)
    if cand is None and not run.fresh:  # no checkpoint: a new run, or one that lost them
        refuse_lost_checkpoints(run_dir, log_name)
    path = str(cand.path) if cand is not None else None
    if cand is not None:
        from nanolab.training.resume import (
            ResumeError,
            check_checkpoint_format,
            check_deepspeed_world_size,
            check_sharded_optimizer_layout,
        )

        try:  # a DeepSpeed folder holds one optimizer shard per rank it was saved on
            check_checkpoint_format(cand.path, strategy_kind)
            check_deepspeed_world_size(cand.path, world_size)
            check_sharded_optimizer_layout(cand.path, strategy_kind, world_size)
        except ResumeError as err:
            raise RunConfigError(str(err)) from None
        refuse_other_optimizer_state(cand, model)
    if path is not None:  # any data that names its tokens: their tokenizer is the run's
        refuse_other_tokenizer(data, path)
    check_data = getattr(data, "check_resume", None)
    if callable(check_data):  # data changed under the run (sizes, meta.json, sampled bytes)
        check_data(path)
    new_id = new_run_id()  # the id a new run takes: the run log and the logger share it
    claim = claim_run_dir(
        run_dir,
        plain_config(cfg),
        resuming=cand is not None,
        fresh=run.fresh,
        checkpoint=cand.path if cand is not None else None,
        checkpoint_run_id=cand.run_id if cand is not None else None,
        checkpoint_run_dir=cand.run_dir if cand is not None else None,
        new_id=new_id,
        logger_dirs=LOGGER_DIRS,  # no logger is built yet: a fresh start moves their folders
    )
    run_id = (
        claim.run_id
        or (cand.run_id if cand is not None else None)
        or owner_of_log(run_dir / log_name)
        or new_id
    )
    # Later files than the one resumed from: a resume from an older checkpoint of the run than
    # its newest (run.resume PATH), or newer ones run.resume auto skipped as unreadable.
    older = (
        cand is not None
        and cand.step is not None
        and _inside(Path(cand.path), folder)
        and (
            bool(cand.skipped_newer)
            or any(
                (s := step_of(p)) is not None and s > cand.step for p in checkpoint_files(run_dir)
            )
        )
    )
    return Claimed(cand, run_id, forked=claim.forked_from is not None, older_than_newest=older)


@dataclass(frozen=True)
class Claimed:
    """What :func:`claim_for_fit` found: the checkpoint to resume from (None: a new run),
    whether it is another run's (this run starts from it: a fine-tune, a branch), and whether
    it is an older checkpoint of this run than its newest (the later ones are set aside once
    the resume has restored, so its saves never overwrite them). ``run_id`` is the run's id,
    a new one's or the resumed one's: the run log and ``--logger`` (W&B's run id) share it."""

    candidate: Any
    run_id: str
    forked: bool = False
    older_than_newest: bool = False


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except (ValueError, OSError):
        return False
    return True


def refuse_lost_checkpoints(run_dir: Path, log_name: str, branched_from: str | None = None) -> None:
    """Refuse to start over in place a run whose log records checkpoints it saved that are now
    gone (its ``checkpoints/`` deleted or moved away): the same command would train from step 0
    again into the same log, which would then hold those steps twice (and ``report`` would count
    a resume). A run that saved no checkpoint (it stopped before its first step, or was killed
    before its first save, e.g. a queue job retried after a hard kill) has nothing to lose: it
    starts again, as before. ``branched_from``: the other run's checkpoint the run started
    from, given again (a branch cannot be started over with ``run.fresh``: that takes no
    checkpoint)."""
    from nanolab.callbacks.rundir import (
        CHECKPOINT_DIR,
        PREVIOUS_DIR,
        checkpoint_files,
        lost_checkpoints,
    )

    if checkpoint_files(run_dir):  # they are there (run.resume never): the claim says what works
        return
    lost = lost_checkpoints(run_dir, log_name)
    if lost is None:
        return
    logged, saved = lost
    over = (
        f"branch from {branched_from} again under another run.name (or move {run_dir} away first)"
        if branched_from is not None
        else f"start it over with run.fresh: true (moves its files to {run_dir / PREVIOUS_DIR}, "
        "nothing is deleted), or start a new run under another run.name"
    )
    raise RunConfigError(
        f"run directory {run_dir} holds a run logged up to step {logged} ({run_dir / log_name}) "
        f"whose checkpoints (the newest of step {saved}) are no longer in "
        f"{run_dir / CHECKPOINT_DIR}; starting it again would log those steps twice. Put its "
        f"checkpoints back and rerun the same command, or {over}"
    )


def continue_own_fork(run_dir: Path, requested: str, log_name: str = RUN_LOG_NAME) -> str:
    """``auto`` when the run directory holds the run that started from ``requested`` and has
    checkpoints of its own: the command that started a fine-tune, run again after a preemption
    (the documented retry loop, a requeue, the queue), continues it from its newest checkpoint
    instead of being refused as a second run, or starting over. Such a run whose checkpoints
    are gone is refused (:func:`refuse_lost_checkpoints`), not started over from ``requested``
    into its own log."""
    from nanolab.callbacks.rundir import checkpoint_files, continues_fork
    from nanolab.callbacks.runlock import global_rank_from_env

    if not checkpoint_files(run_dir):
        if continues_fork(run_dir, requested, log_name):
            refuse_lost_checkpoints(run_dir, log_name, branched_from=requested)
        return requested
    if not continues_fork(run_dir, requested, log_name):
        return requested
    if global_rank_from_env() == 0:
        print(
            f"nanolab fit: {run_dir} holds the run that started from {requested}: it continues "
            "from its own newest checkpoint (run.fresh: true starts it over)",
            file=sys.stderr,
            flush=True,
        )
    return "auto"


def refuse_other_optimizer_state(cand: Any, model: Any) -> None:
    """Refuse, before anything is written, to resume (or branch from) a checkpoint whose
    optimizer state cannot continue under this model's ``model.optimizer.name`` or
    ``model.freeze``: torch cannot load another optimizer's state, nor one for other trainable
    parameters ("a parameter group that doesn't match the size"). The rule is the checkpoint's
    own record (:func:`nanolab.training.resume.optimizer_state_problem`, which ``queue add``
    asks too); a checkpoint that predates its ``freeze`` record is compared by the number of
    parameters its optimizer state holds."""
    from nanolab.training.resume import optimizer_state_problem

    optimizer = getattr(model, "optimizer_config", None)
    freeze = getattr(model, "freeze_config", None)
    now = asdict(freeze) if freeze is not None else None
    problem = optimizer_state_problem(
        cand.nanolab, getattr(optimizer, "name", None), now, cand.path
    )
    if problem is not None:
        raise RunConfigError(problem)
    if now is None or isinstance((cand.nanolab or {}).get("freeze"), dict):
        return
    trained = _trained_parameters(cand.path)
    net = getattr(model, "model", None)
    if trained is None or net is None:
        return
    trains = sum(1 for p in net.parameters() if p.requires_grad)
    if trained != trains:
        raise RunConfigError(
            f"{cand.path} was trained with {trained} trainable parameter tensors (this run's "
            f"model.freeze.embeddings {flag_value(now['embeddings'])}, blocks {now['blocks']}: "
            f"{trains}): its optimizer state cannot continue another set. Resume with the "
            f"model.freeze it was saved with, or start a new run from its weights (nanolab "
            f"export --ckpt {cand.path} --format safetensors -o DIR, then --model.init_from "
            "DIR with the new model.freeze)"
        )


def launch_classes(cfg: Any, model: Any, data: Any) -> dict[str, Any]:
    """This launch's model and data classes and their own settings, as checkpoints record
    them (:mod:`nanolab.training.class_settings`)."""
    from nanolab.training.class_settings import classes_record

    def settings(section: Any) -> dict[str, Any] | None:
        init_args = section.get("init_args") if section is not None else None
        return init_args.as_dict() if hasattr(init_args, "as_dict") else None

    return classes_record(model, settings(cfg.get("model")), data, settings(cfg.get("data")))


def refuse_changed_class_settings(
    cfg: Any, cand: Any, model: Any, data: Any, run_dir: Path
) -> None:
    """Refuse, before anything is written, a resume of the run that asks for another value of
    a setting its model or data class adds (``model.label_smoothing`` of a fork's model,
    ``data.max_train_tokens`` of its data): nanolab cannot tell whether the run may change one
    half-way (the subset it trains on, the network's shape), and taking it silently would make
    ``config.yaml`` say the run always had it. The line names the value it trained with and the
    branch command that trains with the new one. A checkpoint of an earlier nanolab (no
    record) is not compared."""
    from nanolab.training.class_settings import (
        CLASSES_KEY,
        changed_own_settings,
        changed_settings_line,
    )

    saved = (cand.nanolab or {}).get(CLASSES_KEY)
    now = getattr(model, "class_record", None) or launch_classes(cfg, model, data)
    changed = changed_own_settings(saved, now)
    if not changed:
        return
    wanted = {key: flag_value(new) for key, _, new in changed}
    branch = branch_command(run_dir, str(cfg.run.name), cand.path, wanted)
    raise RunConfigError(changed_settings_line(changed, saved, cand.path, branch))


def _trained_parameters(path: Any) -> int | None:
    """How many parameter tensors a checkpoint's optimizer state is for (None: unknown, a
    sharded folder or an unreadable file, which the resume itself reports)."""
    import torch

    if Path(str(path)).is_dir():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        groups = [g for opt in state["optimizer_states"] for g in opt["param_groups"]]
        return sum(len(g["params"]) for g in groups)
    except Exception:
        return None


def keep_checkpoint_settings(
    cfg: Any,
    path: Any,
    data: Any = None,
    random_seed: bool = False,
    seeds: bool = True,
    run_dir: Path | None = None,
) -> None:
    """A resume restores the optimizer and LR schedule state, so ``model.optimizer`` and
    ``model.schedule`` values changed since cannot take effect: say so in one line and write
    the checkpoint's values into the config (config.yaml, the start record) before anything is
    written, so the run's files name what it trains with. The same for the run's seeds: the
    RNG streams come back from the checkpoint (``seed_everything`` changes nothing but the
    run's label), and another ``data.seed`` would draw the rest of the epoch from another
    window order (windows seen twice, others never), so the checkpoint's are kept
    (``random_seed``: ``seed_everything: true`` drew a new one at this launch; the run's is kept
    without a word); the warning names the branch command that trains with the new values.
    ``seeds`` False: a branch, a new run from another run's checkpoint, whose seeds are its own
    to choose (branches of one parent on other data orders), and whose optimizer settings and
    schedule are its own too (:mod:`nanolab.training.branch`; but :data:`BRANCH_KEEPS`): one
    line says which differ from its parent's. A resume of the run itself says each setting it
    takes anew (:func:`say_taken_settings`). A sharded checkpoint folder (FSDP2, DeepSpeed) is
    read as a file is, from the state its strategy saved beside the shards
    (:func:`~nanolab.model.checkpoint.sharded_metadata`)."""
    import torch

    from nanolab.callbacks.runlock import global_rank_from_env

    if Path(str(path)).is_dir():  # a sharded folder: the state its strategy saved beside the shards
        from nanolab.model.checkpoint import sharded_metadata

        state = sharded_metadata(path)
        if state is None:  # the resume itself reports a bad folder
            return
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # the resume itself reports a bad file
            return
    saved = state.get("nanolab")
    model_args = cfg.model.init_args
    kept: list[str] = []
    wanted: dict[str, Any] = {}  # what this launch asked for and cannot have: key -> value
    taken: list[tuple[str, Any, Any]] = []  # a branch's own settings: (key, its, the parent's)
    for part in ("optimizer", "schedule"):
        before, now = (saved or {}).get(part), model_args.get(part)
        if not isinstance(before, dict) or now is None:
            continue
        for key, value in before.items():
            if key == "name" or key not in now:
                continue
            current = now[key]
            same = list(current) == list(value) if isinstance(value, list) else current == value
            if same:
                continue
            if not seeds and key not in BRANCH_KEEPS:
                taken.append((f"model.{part}.{key}", current, value))
                continue
            kept.append(f"model.{part}.{key} {value} (not {current})")
            wanted[f"model.{part}.{key}"] = flag_value(current)
            now[key] = value
    seed = (saved or {}).get("seed_everything") if seeds else None
    if isinstance(seed, int) and cfg.get("seed_everything") not in (seed, False, None):
        if not random_seed:
            kept.append(f"seed_everything {seed} (not {cfg.seed_everything})")
            wanted["seed_everything"] = cfg.seed_everything
        cfg.seed_everything = seed
        os.environ["PL_GLOBAL_SEED"] = str(seed)  # what this run's checkpoints record as its seed
    data_seed = (_saved_data_state(state) or {}).get("seed") if seeds else None
    data_args = cfg.data.get("init_args") if cfg.get("data") else None
    if (
        isinstance(data_seed, int)
        and data_args is not None
        and data_args.get("seed") not in (None, data_seed)
    ):
        kept.append(f"data.seed {data_seed} (not {data_args.seed})")
        wanted["data.seed"] = data_args.seed
        data_args.seed = data_seed
        if data is not None and hasattr(data, "seed"):
            data.seed = data_seed
    if seeds and global_rank_from_env() == 0:
        say_taken_settings(cfg, state, run_dir)
    if global_rank_from_env() != 0:
        return
    if taken:
        print(branch_settings_line(taken, state.get("global_step")), file=sys.stderr, flush=True)
    if kept and seeds:
        command = branch_command(run_dir or Path(str(path)).parent, cfg.run.name, path, wanted)
        print(
            f"nanolab: warning: resuming keeps the checkpoint's {', '.join(kept)}: the optimizer "
            "and schedule state, the RNG streams and the data order are restored with it, and "
            "config.yaml says so; to train with the new values, branch a new run from this "
            f"checkpoint: {command}",
            file=sys.stderr,
            flush=True,
        )
    elif kept:
        print(
            f"nanolab: warning: this branch keeps its parent's {', '.join(kept)}: the "
            "optimizer's restored state is placed for its kernel, and config.yaml says so",
            file=sys.stderr,
            flush=True,
        )


def branch_settings_line(taken: list[tuple[str, Any, Any]], step: Any) -> str:
    """The line of a branch that trains with optimizer or schedule settings of its own:
    ``taken`` holds (key, the branch's value, the parent's). ``step`` is the checkpoint's
    (the parent's last step, trained with the parent's values): the branch's first step, the
    first with its own values, is the one after it."""
    keys = ", ".join(f"{key} {flag_value(mine)}" for key, mine, _ in taken)
    theirs = ", ".join(flag_value(parents) for _, _, parents in taken)
    were = "was" if len(taken) == 1 else "were"
    return (
        f"nanolab fit: this branch trains with {keys} {_after_step(step)}; its parent's {were} "
        f"{theirs} (the optimizer's moments and step counts are its parent's)"
    )


def _after_step(step: Any) -> str:
    """When a branch from the step-``step`` checkpoint starts: from the step after the
    checkpoint's, the parent's last (``from step 8, after its parent's step 7``)."""
    if isinstance(step, int) and not isinstance(step, bool):
        return f"from step {step + 1}, after its parent's step {step}"
    return "after its parent's last step"


#: Settings a resume takes anew although they change what the run computes from here: the
#: regularisation and clipping of the steps, and the windows each evaluation scores (which the
#: best val loss and the plateau rule compare). Their old value comes from the checkpoint's own
#: record where it keeps one (``model.gpt``, the data's state), else from the launch that saved
#: it (its ``start`` record, or config.yaml).
TAKEN_ON_RESUME = (
    "model.gpt.dropout",
    "trainer.gradient_clip_val",
    "trainer.gradient_clip_algorithm",
    "data.val_windows",
)


def say_taken_settings(cfg: Any, state: dict[str, Any], run_dir: Path | None) -> None:
    """One line for each of :data:`TAKEN_ON_RESUME` this resume changes: the run goes on with
    the new value, and config.yaml then names it for the whole run, so the line says up to which
    step the old one trained (each launch's ``start`` record in the run log holds its own)."""
    step = state.get("global_step")
    recorded: dict[str, Any] = {}
    gpt = (state.get("nanolab") or {}).get("gpt")
    if isinstance(gpt, dict) and "dropout" in gpt:
        recorded["model.gpt.dropout"] = gpt["dropout"]
    data_state = _saved_data_state(state) or {}
    if "val_windows" in data_state:
        recorded["data.val_windows"] = data_state["val_windows"]
    before = None  # the config of the launch that saved the checkpoint, read once if needed
    now = plain_config(cfg)
    for key in TAKEN_ON_RESUME:
        if key not in recorded and before is None:
            before = _saving_launch_config(run_dir, cfg, step) or {}
        old = recorded[key] if key in recorded else _dotted(before or {}, key)
        new = _dotted(now, key)
        if old is _UNKNOWN or new is _UNKNOWN or old == new:
            continue
        was, is_ = flag_value(old), flag_value(new)
        what = (
            f"its evaluations up to step {step} scored {was} windows, the rest score {is_} (the "
            "best val loss and the plateau rule compare both)"
            if key == "data.val_windows"
            else f"its steps up to {step} trained with {was}, the rest train with {is_}"
        )
        print(
            f"nanolab: warning: resuming with {key} {is_}: {what}, and config.yaml says {is_} "
            "(each launch's start record in the run log holds its own); to keep one value, "
            f"resume with --{key} {was}",
            file=sys.stderr,
            flush=True,
        )


_UNKNOWN = object()


def _dotted(config: dict[str, Any], key: str, missing: Any = _UNKNOWN) -> Any:
    """``config``'s value at a dotted key (``model.gpt.dropout``; a jsonargparse model's
    settings sit under ``init_args``), or ``missing``."""
    node: Any = config
    for part in key.split("."):
        if isinstance(node, dict) and part not in node and "init_args" in node:
            node = node["init_args"]
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def _saving_launch_config(run_dir: Path | None, cfg: Any, step: Any) -> dict[str, Any] | None:
    """The config of the launch that saved the step-``step`` checkpoint of the run in
    ``run_dir``: the ``start`` record before that checkpoint's record in the run log, else (no
    record of the save: a launch killed before it logged it) the last ``start`` of a step before
    ``step`` (a launch saves only steps past its own start: one that resumed from this
    checkpoint and was killed did not save it), else the run's config.yaml (the last launch's)."""
    if run_dir is None:
        return None
    import contextlib

    from nanolab.runlog import iter_backwards
    from nanolab.runs import config_of

    log = run_dir / str(cfg.get("log", {}).get("filename") or RUN_LOG_NAME)
    saved_seen = False
    start = None
    with contextlib.closing(iter_backwards(log, ("checkpoint", "start"))) as newest_first:
        for record in newest_first:
            at = record.get("step")
            if record.get("event") == "checkpoint" and at == step:
                saved_seen = True
            elif record.get("event") == "start" and isinstance(at, int):
                if saved_seen or (start is None and at < (step or 0)):
                    start = record
                if saved_seen:
                    break
    config = start.get("config") if start else None
    return config if isinstance(config, dict) else config_of([], run_dir)


def nothing_to_train(
    cfg: Any,
    run_dir: Path,
    step: int,
    max_steps: int,
    forked: bool,
    checkpoint: Path | str | None = None,
) -> str:
    """The line of a launch whose checkpoint is at or past its ``trainer.max_steps``. A run a
    longer launch extended and that stopped short of it (asked for 800, preempted at 611) is
    not complete: the line names both numbers and the option that finishes it, instead of
    calling it complete under this launch's smaller max_steps. A complete run whose LR cosine
    ended by ``step`` (:func:`_cosine_end`) trains any extra steps at the schedule's minimum
    (a resume keeps the plan): the line says so, with the branch (``checkpoint``) whose
    cosine is planned for the longer run."""
    config = None if forked else _saving_launch_config(run_dir, cfg, step)
    asked = _dotted(config, "trainer.max_steps", None) if isinstance(config, dict) else None
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > step:
        return (
            f"{run_dir} stopped at step {step} of the {asked} its last launch asked for; this "
            f"launch's trainer.max_steps is {max_steps}, so there is nothing to train. "
            f"Continue it with --trainer.max_steps {asked}, or give another --run.name for a "
            "new run"
        )
    end = None if forked else _cosine_end(run_dir)
    if end is None or end > step:
        return (
            f"{run_dir} is already complete at step {step} (trainer.max_steps {max_steps}); "
            "nothing to train. Raise --trainer.max_steps to extend it, or give another "
            "--run.name for a new run"
        )
    longer = {"trainer.max_steps": 2 * step}
    branch = branch_command(run_dir, run_dir.name, checkpoint, longer) if checkpoint else None
    alternative = (
        f"branch it, whose cosine is planned for its own end: {branch}"
        if branch
        else "give another --run.name for a new run"
    )
    return (
        f"{run_dir} is already complete at step {step} (trainer.max_steps {max_steps}); "
        f"nothing to train. Raising --trainer.max_steps extends it, but its LR cosine ended at "
        f"step {end} (a resume keeps the plan), so the extra steps train at the schedule's "
        f"minimum; for a cosine over the longer run, {alternative}"
    )


def _cosine_end(run_dir: Path) -> int | None:
    """The step where the LR cosine of the run in ``run_dir`` reaches its minimum, as its first
    launch planned it (the checkpoint keeps that plan): ``model.schedule.decay_steps``, else
    that launch's ``trainer.max_steps``. None where it is not known (no log, a schedule of a
    fork's own, a budget-planned or constant LR)."""
    from nanolab.runlog import iter_records

    first = next(iter_records(run_dir / RUN_LOG_NAME, "start"), None)
    config = (first or {}).get("config")
    if not isinstance(config, dict):
        return None
    schedule = _dotted(config, "model.schedule", None)
    if not isinstance(schedule, dict) or _number(schedule.get("min_lr_ratio", 0.1)) >= 1:
        return None  # a constant LR after the warm-up: longer is the same rate
    end = schedule.get("decay_steps")
    if end is None:
        end = _dotted(config, "trainer.max_steps", None)
    return end if isinstance(end, int) and not isinstance(end, bool) and end > 0 else None


def _number(value: Any) -> float:
    """``value`` as a float (a value that is none: 0)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _saved_data_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """The state a checkpoint's TokenDataModule saved (under its class name, with the data
    fingerprint), or None (another DataModule)."""
    for value in state.values():
        if isinstance(value, dict) and "data_fingerprint" in value:
            return value
    return None


def requested_checkpoint(resume: str, ckpt_path: Any) -> tuple[str | None, str]:
    """What to resume from: ``--ckpt_path`` or ``run.resume`` (auto/never/a path), and the
    name of the setting that asked for it (for messages)."""
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


def open_checkpoint(
    requested: str, flag: str, run_dir: Path, model: Any, training: bool, data: Any = None
) -> Any:
    """Open the checkpoint without running its pickle and check it fits this model: a bad
    file is one error line (exit 2), never a traceback from deep inside Lightning. A model
    that differs because ``data`` is not the data the checkpoint trained on is named as what
    changed: another tokenizer (its vocabulary sizes the model: the checkpoint's tokenizer
    and the data's, with :func:`refuse_other_tokenizer`'s fix, flag or not), else another
    ``data.dataset_dir``."""
    from nanolab.training.resume import (
        DifferentModelError,
        ResumeError,
        check_same_shapes,
        resume_candidate,
    )

    gpt = getattr(model, "gpt_config", None)
    try:
        cand = resume_candidate(requested, run_dir, asdict(gpt) if gpt else None, flag, training)
        if cand is not None and getattr(model, "model", None) is not None:
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            check_same_shapes(cand, expected, flag)
    except DifferentModelError as err:
        if training and err.checkpoint:  # another tokenizer's vocabulary: say that, not shapes
            refuse_other_tokenizer(data, str(err.checkpoint))
        moved = getattr(data, "changed_since", None)
        other_data = moved(err.checkpoint) if callable(moved) and err.checkpoint else None
        raise RunConfigError(f"{flag}: {other_data}" if other_data else str(err)) from None
    except ResumeError as err:
        raise RunConfigError(str(err)) from None
    return cand


def evaluation_checkpoint(verb: str, cfg: Any, run_dir: Path, data: Any) -> Any:
    """The checkpoint ``validate``/``test`` scores (docs/evaluate.md): the run's newest by
    default, never an untrained model unless ``--ckpt_path none``. The file picked is held open
    and read through its descriptor, so a live run's rotation cannot delete it in between.
    Picked before the model is sized by the data, to refuse data of another tokenizer first:
    a larger vocabulary than the model's would be refused in words that do not apply to a
    checkpoint, a smaller one would score."""
    from nanolab.callbacks.evaluation_log import log_owner, scored_run
    from nanolab.training.evaluate import EvaluateError, eval_target

    init_from = bool(cfg.model.init_args.get("init_from"))
    owner = log_owner(run_dir)  # before the pick: a run that replaces this one changes it
    try:
        target = eval_target(cfg.get("ckpt_path"), run_dir, verb, has_init_from=init_from)
    except EvaluateError as err:
        raise RunConfigError(str(err)) from None
    target.run_id = scored_run(target.run_id, owner)
    dataset_dir = getattr(data, "dataset_dir", None)
    if target.path is not None and dataset_dir is not None:
        from nanolab.model.checkpoint import read_path
        from nanolab.model.hf_tokenizer import check_scored_data

        saved = mapped_checkpoint(read_path(target.path))  # a sharded folder: not checked
        spec = ((saved or {}).get("nanolab") or {}).get("tokenizer")
        check_scored_data(Path(dataset_dir), spec, target.path, verb)
    return target


def refuse_other_tokenizer(data: Any, ckpt_path: str) -> None:
    """Before a resume or a branch: refuse data not tokenized with the checkpoint's tokenizer,
    as validate does. ``data.allow_changed`` allows other text, never another tokenizer: its
    ids would index other tokens' rows, and a run would train on them without an error. A
    project's DataModule of windows that names its tokens (``dataset_dir``, whose tokenizer its
    checkpoints keep) is checked the same way: tokens prepared anew under it would otherwise
    swap the run's tokenizer without a word, and generate, eval and export decode wrongly."""
    tokens = tokens_folder(data)
    if tokens is None:
        return
    folder, field = tokens
    from nanolab.data.checks import checkpoint_tokenizer
    from nanolab.model.hf_tokenizer import check_scored_data

    new_run = "start a new run without its checkpoint (another --run.name, no run.resume)"
    if hasattr(data, "allow_changed"):
        fix = (
            "continue it on data prepared with its tokenizer (data.allow_changed allows other "
            f"text, not another tokenizer), or {new_run}"
        )
    else:  # a DataModule of windows has no allow_changed to mention
        fix = f"continue it on data prepared with its tokenizer, or {new_run}"
    before = trained_elsewhere(data, ckpt_path)
    if before is not None:  # pointed at other data by mistake, maybe: the data it trained on
        fix = (
            f"restore data.dataset_dir (or data.datasets) to the data it trained on, {before}, "
            f"or {new_run}; data.allow_changed allows other text, not another tokenizer"
        )
    spec = checkpoint_tokenizer(ckpt_path)
    check_scored_data(folder, spec, Path(ckpt_path), "resume", fix, field)


def tokens_folder(data: Any) -> tuple[Path, str] | None:
    """The prepared tokens whose tokenizer ``data`` trains with, and what names them in a
    message: nanolab's own data's first folder (``data.dataset_dir`` or ``data.datasets``; a
    mixture's folders share one tokenizer), or the ``dataset_dir`` a DataModule of windows
    sets (its checkpoints keep that folder's tokenizer). None when there is none to check."""
    parts = getattr(data, "parts", None)
    if parts:
        return Path(parts[0].path), "data.dataset_dir"
    if parts is not None:  # nanolab's own data, nothing prepared yet: nothing to compare
        return None
    folder = getattr(data, "dataset_dir", None)
    if folder is None or not (Path(folder) / "meta.json").is_file():
        return None
    return Path(folder), f"{type(data).__name__}.dataset_dir"


def trained_elsewhere(data: Any, ckpt_path: str) -> str | None:
    """The folders the checkpoint's run trained on, when ``data`` points at others and they
    are still there (a folder moved since is the same data), else None."""
    from nanolab.data.checks import checkpoint_fingerprint

    saved = checkpoint_fingerprint(ckpt_path, type(data).__qualname__)
    before = [str(d.get("path")) for d in (saved or {}).get("datasets") or []]
    now = {str(p.path) for p in getattr(data, "parts", None) or ()}
    if not before or set(before) == now or not all(Path(b).is_dir() for b in before):
        return None
    return ", ".join(before)


def evaluation_target(
    verb: str,
    run_dir: Path,
    model: Any,
    target: Any,
    data: Any = None,
    strategy_kind: str = "single",
) -> tuple[Any, str | None]:
    """What ``validate``/``test`` evaluates (``target``, from :func:`evaluation_checkpoint`)
    and the path Lightning loads it from. The result is appended to the run log (holding the
    run directory for the append only: :func:`log_evaluation`) only when it scores the run's
    own data and validation windows (a record of other data would pass in ``report`` for the
    run's val loss)."""
    if target.path is None:
        return target, None
    cand = open_checkpoint(str(target.path), "--ckpt_path", run_dir, model, training=False)
    # A folder given (a run directory) names the file it resolved to, and its step, in the
    # printed line and the record: what was scored is that file.
    target.path = Path(cand.path)
    if target.step is None and isinstance(cand.step, int):
        target.step = cand.step
    from nanolab.model.checkpoint import read_path
    from nanolab.training.resume import ResumeError, check_checkpoint_format

    try:  # a sharded folder only its own strategy reads: one line, not a traceback
        check_checkpoint_format(cand.path, strategy_kind)
    except ResumeError as err:
        raise RunConfigError(str(err)) from None
    source = read_path(cand.path)  # the held file's descriptor: the name may be gone by now
    saved = mapped_checkpoint(source)  # read once, for both checks below
    if saved is not None:
        from nanolab.model.checkpoint import model_weights, non_finite_error

        # NaN weights score NaN (printed "-", exit 0, and logged for the run): refuse them in
        # eval's words. A module of one's own may name its weights otherwise: all of them.
        refused = non_finite_error(model_weights(saved) or saved["state_dict"], target.path)
        if refused is not None:
            raise refused
    other = other_data(data, saved) if target.log_to_run else None
    if other is not None:
        from nanolab.callbacks.runlock import global_rank_from_env

        target.log_to_run = False
        if global_rank_from_env() == 0:
            print(f"nanolab {verb}: not logged to {run_dir}: {other}", file=sys.stderr, flush=True)
    return target, str(source)


def mapped_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint file ``path`` memory-mapped (its tensors' bytes are read only when
    used), or None for a sharded folder or a file that does not load (Lightning's restore
    says why)."""
    if path.is_dir():
        return None
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return ckpt if isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict) else None


def other_data(data: Any, ckpt: dict[str, Any] | None) -> str | None:
    """How ``data`` differs from what the checkpoint ``ckpt`` was trained and validated on
    (its datasets' content, its validation windows), or None: the same, or nothing to compare
    (a DataModule of one's own, a sharded folder, a checkpoint older than the saved state)."""
    fingerprint = getattr(data, "data_fingerprint", None)
    if not callable(fingerprint) or ckpt is None:
        return None
    from nanolab.data.checks import data_changes

    saved = _saved_data_state(ckpt)
    if saved is None:
        return None
    changes = data_changes(saved.get("data_fingerprint") or {}, fingerprint())
    if changes:
        return "it scores other data than the run's (" + "; ".join(changes[:2]) + ")"
    windows, now = saved.get("val_windows"), getattr(data, "val_windows", None)
    if windows is not None and now is not None and windows != now:
        return f"data.val_windows is {now}, the run validates on {windows}"
    return None


def log_evaluation(trainer: Trainer, verb: str, run_dir: Path, target: Any) -> None:
    """Append an evaluation of the run's own checkpoint to its run log, holding the run
    directory for the append only: held for the whole evaluation, it refused a ``fit`` of the
    run started meanwhile (a queued continuation, a resume loop). A ``fit`` holding it now
    keeps its log to itself, and a run started there since (``--run.fresh``) is another run:
    the result stays printed, with one warning, and this succeeds
    (:mod:`nanolab.callbacks.evaluation_log`)."""
    from nanolab.callbacks.evaluation_log import append_evaluation
    from nanolab.callbacks.jsonl import to_floats
    from nanolab.training.evaluate import eval_record

    stage = "val" if verb == "validate" else "test"
    metrics = to_floats(dict(trainer.callback_metrics))
    record = eval_record(verb, stage, metrics, target)
    path = append_evaluation(run_dir, record, target.run_id, f"nanolab {verb}")
    if path is not None:
        rank_zero_info(f"{stage} record (step {target.step}) appended to {path}")


def callback_class_paths(given: Any) -> list[str]:
    """The class paths ``trainer.callbacks`` names, in order."""
    items = given if isinstance(given, list) else [] if given is None else [given]
    paths = []
    for item in items:
        path = item.get("class_path") if hasattr(item, "get") else item
        if isinstance(path, str):
            paths.append(path)
    return paths


def callback_build_error(err: BaseException, class_paths: list[str]) -> RunConfigError | None:
    """One line for a ``trainer.callbacks`` class whose constructor raised, found by the frame
    of its ``__init__`` in the traceback; ``None`` when the error came from elsewhere (a bug of
    the model or data keeps its traceback)."""
    import traceback

    for frame, _ in reversed(list(traceback.walk_tb(err.__traceback__))):
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        cls = type(owner)
        for path in class_paths:
            if path in (f"{cls.__module__}.{cls.__qualname__}", cls.__qualname__):
                problem = f"{type(err).__name__}: {err}".splitlines()[0]
                return RunConfigError(
                    f"trainer.callbacks: {path} could not be built ({problem}); fix its "
                    "init_args or remove it from trainer.callbacks"
                )
    return None


def check_logger_callbacks(callbacks: list[Any], logger: Any) -> None:
    """A callback that writes through a Lightning logger (``LearningRateMonitor``) on a run
    without one: Lightning refuses it at the first step, a traceback after the run directory
    was claimed. Said now, with the fix. ``logger`` is ``trainer.logger``: only False (or no
    logger in a list) is none; None is Lightning's default logger."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    if logger not in (False, []):
        return
    for i, cb in enumerate(callbacks):
        if isinstance(cb, LearningRateMonitor):
            raise RunConfigError(
                f"trainer.callbacks[{i}] ({type(cb).__name__}) writes through a logger and this "
                "run has none; add --logger csv (or tensorboard, wandb), or leave it out: the run "
                "log (metrics.jsonl) records lr at every logged step"
            )


def check_lambda_callbacks(callbacks: list[Any]) -> None:
    """Each function given to a ``LambdaCallback`` must take the arguments its hook is called
    with; otherwise the run would fail with a traceback at that hook, minutes in."""
    import inspect

    from lightning.pytorch.callbacks import Callback, LambdaCallback

    for cb in callbacks:
        if not isinstance(cb, LambdaCallback):
            continue
        for hook, func in vars(cb).items():
            base = getattr(Callback, hook, None)
            if not callable(func) or base is None:
                continue
            names = list(inspect.signature(base).parameters)[1:]  # without self
            try:
                inspect.signature(func).bind(*names)
            except TypeError:
                where = getattr(func, "__qualname__", repr(func))
                raise RunConfigError(
                    f"trainer.callbacks: LambdaCallback {hook}={where} cannot be called with "
                    f"the hook's arguments ({', '.join(names)}); give a function taking them"
                ) from None
            except ValueError:  # no signature to read (some builtins): let it run
                continue
