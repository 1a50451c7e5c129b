"""``--logger tensorboard|csv|wandb|mlflow``: experiment trackers fed from the run log.

Lightning logs ``self.log`` values at its own step counter (the step *being* taken, so
``train/loss`` lands one step before the run log's, and validation two counters further off),
and never sees the learning rate, the gradient norm or throughput, which nanolab's run log
computes. So here the loggers get exactly what ``metrics.jsonl`` gets: every ``train`` and
``val`` record is forwarded by the run log callback, at the record's ``step`` (optimizer steps
done), and Lightning's own ``log_metrics`` calls to them are dropped, so there is one step axis.

Files go inside the run directory (``<run_dir>/tensorboard``, ``<run_dir>/csv``,
``<run_dir>/wandb``, ``<run_dir>/mlruns``: :data:`~nanolab.callbacks.rundir.LOGGER_DIRS`), at a
fixed place so a resumed run continues the same logger run: TensorBoard and CSV keep writing the
same folder (the CSV file is appended to, never replaced), W&B reuses an id made of the run's id
(a run begun before that keeps the id its W&B run has, :func:`wandb_run_id`).
A fresh start (``run.fresh``) moves those folders to ``previous/`` with the old run, and its new
run id starts a new W&B run, so the logger is built after the run directory is claimed.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from nanolab.atomic import write_whole
from nanolab.errors import NanolabError

#: shorthand -> (import name that must be present, pip command that provides it)
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install 'nanolab[tensorboard]'"),
    "wandb": ("wandb", "pip install 'nanolab[wandb]'"),
    "mlflow": ("mlflow", "pip install mlflow"),
    "csv": (None, ""),
}
LOGGER_CHOICES = tuple(PACKAGES)


class LoggerUnavailableError(NanolabError):
    """The logger's package is not installed; the message gives the pip command."""


def check_available(name: str) -> None:
    """Raise with the pip command when ``--logger name`` cannot be imported here."""
    module, pip = PACKAGES[name]
    if module is None:
        return
    # Lightning's TensorBoard logger takes either package.
    names = (module, "tensorboardX") if name == "tensorboard" else (module,)
    if all(importlib.util.find_spec(m) is None for m in names):
        raise LoggerUnavailableError(
            f"--logger {name} needs the {module} package, which is not installed: {pip}"
        )


#: The folder W&B writes for each process of a run into ``<save_dir>/wandb``:
#: ``run-<YYYYMMDD_HHMMSS>-<id>`` (``offline-run-...`` when offline).
_WANDB_RUN_FOLDER = re.compile(r"(?:offline-)?run-(?P<stamp>\d{8}_\d{6})-(?P<id>.+)")


def wandb_run_id(run_name: str, run_id: str, run_dir: Path | None = None) -> str:
    """W&B's id for the run: the same across its resumes (``resume="allow"`` continues it),
    a new one for a fresh start in the same directory, which takes a new run id.

    A run begun before ids were made of the run id has ``<run name>-<8 hex digits>`` (a
    digest of its directory's path): when ``run_dir``'s ``wandb/`` folder holds a W&B run
    under such an id and none under the new one, that id is kept, so the run's resume goes
    on in its W&B run instead of starting a second one. A fresh start moved the folder aside
    with the old run, so it gets the new id."""
    new = f"{run_name}-{run_id}"
    if run_dir is None:
        return new
    old_form = re.compile(rf"{re.escape(run_name)}-[0-9a-f]{{8}}")
    found = sorted(  # by the folder's time stamp: the newest last
        (match["stamp"], match["id"])
        for folder in _listing(Path(run_dir) / "wandb")
        if (match := _WANDB_RUN_FOLDER.fullmatch(folder.name)) is not None
    )
    ids = [wandb_id for _, wandb_id in found]
    older = [i for i in ids if old_form.fullmatch(i)]
    return older[-1] if older and new not in ids else new


def _listing(folder: Path) -> list[Path]:
    """What ``folder`` holds (nothing when it is missing or cannot be read)."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def make_logger(name: str, run_dir: Path, run_name: str, run_id: str) -> Any:
    """The Lightning logger for ``--logger name``, writing inside ``run_dir``, for the run of
    id ``run_id`` (the run log's)."""
    check_available(name)
    if name == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        # name/version "": the event files go straight into <run_dir>/tensorboard.
        return TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="")
    if name == "csv":
        return AppendingCSVLogger(save_dir=str(run_dir), name="csv", version="")
    if name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        return WandbLogger(
            save_dir=str(run_dir),
            name=run_name,
            id=wandb_run_id(run_name, run_id, run_dir),
            resume="allow",
            project=os.environ.get("WANDB_PROJECT", "nanolab"),
        )
    from lightning.pytorch.loggers import MLFlowLogger

    return MLFlowLogger(
        experiment_name="nanolab",
        run_name=run_name,
        tracking_uri=f"file:{(run_dir / 'mlruns').absolute()}",
    )


def AppendingCSVLogger(**kwargs: Any) -> Any:
    """A :class:`~lightning.pytorch.loggers.CSVLogger` that appends to ``metrics.csv``."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    class AppendingExperimentWriter(ExperimentWriter):
        """Lightning's CSV writer deletes an existing ``metrics.csv``; a resumed run appends.

        Lightning has no option for that, so this overrides its private ``_check_log_dir_exists``
        and reads the private ``_fs`` (as ``_AppendingCSVLogger`` does with ``_experiment``).
        """

        def _check_log_dir_exists(self) -> None:
            if self._fs.isfile(self.metrics_file_path):
                import csv

                with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                    header = next(csv.reader(f), [])
                self.metrics_keys = sorted(header)

    class _AppendingCSVLogger(CSVLogger):
        """CSVLogger that keeps the rows an earlier process of the run wrote."""

        @property
        def experiment(self) -> Any:
            if self._experiment is None:
                self._fs.makedirs(self.root_dir, exist_ok=True)
                self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
            return self._experiment

    return _AppendingCSVLogger(**kwargs)


# -- one step axis ------------------------------------------------------------------------------
_SKIP = frozenset({"event", "time", "step", "epoch"})


def mute_lightning_metrics(trainer: Any) -> None:
    """Drop Lightning's own ``log_metrics`` calls; :func:`forward_record` uses the original."""
    for logger in getattr(trainer, "loggers", None) or []:
        if "_nanolab_log_metrics" in vars(logger):
            continue
        logger._nanolab_log_metrics = logger.log_metrics
        logger.log_metrics = _ignore


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def logger_metrics(
    record: dict[str, Any], withheld: frozenset[str] = frozenset()
) -> dict[str, float]:
    """A run-log record's numbers as logger metric names (``train/lr``, ``val/loss``, ...),
    less the fields named in ``withheld``."""
    event = record.get("event")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _SKIP or key in withheld or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)):
            continue
        if "/" in key:
            out.setdefault(key, float(value))
        elif event == "val" and key.startswith("val_"):
            out[f"val/{key.removeprefix('val_')}"] = float(value)
        elif event == "train":
            out[f"train/{key}"] = float(value)
    return out


def withheld_fields(trainer: Any) -> frozenset[str]:
    """The record fields some callback keeps from the loggers (its ``withheld_from_loggers``,
    e.g. ``throughput.log_to_loggers: false``)."""
    withheld: frozenset[str] = frozenset()
    for callback in getattr(trainer, "callbacks", None) or []:
        withheld |= getattr(callback, "withheld_from_loggers", frozenset())
    return withheld


def forward_record(trainer: Any, record: dict[str, Any]) -> None:
    """Send a ``train``/``val``/``tasks`` record to every logger at the record's step (rank 0).

    The one way numbers reach a logger in a nanolab run: throughput too arrives here, as
    ``train/tokens_per_s``, ``train/mfu``, ..., next to ``train/loss`` at the same step.
    """
    if record.get("event") not in ("train", "val", "tasks") or not isinstance(
        record.get("step"), int
    ):
        return
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers or not (metrics := logger_metrics(record, withheld_fields(trainer))):
        return
    for logger in loggers:
        log = vars(logger).get("_nanolab_log_metrics", logger.log_metrics)
        log(metrics, step=int(record["step"]))


# -- config.yaml --------------------------------------------------------------------------------
def as_recorded(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the run's files record it (``config.yaml``, the start record): without
    this launch's actions on the run directory. ``run.fresh: true`` moved an earlier run aside
    before this one started; recorded, a relaunch from the run's own ``config.yaml`` (the
    queue's, a requeue's, a user's) would move this run aside in turn and start it over, where
    it should resume. The same for a ``run.resume`` (or ``--ckpt_path``) naming one of the
    run's own checkpoints, recorded as ``auto``. (One naming another run's checkpoint stays: a
    relaunch of that branch continues from its own newest checkpoint, or starts from that one
    again when it saved none.)"""
    out = dict(config)
    for group in ("run", "log"):  # log.fresh: the run log's side of run.fresh (linked)
        section = out.get(group)
        if isinstance(section, dict) and section.get("fresh"):
            out[group] = {**section, "fresh": False}
    run_dir = (out.get("trainer") or {}).get("default_root_dir")
    run = out.get("run")
    if run_dir is None or not isinstance(run, dict):
        return out
    named = [run.get("resume"), out.get("ckpt_path")]
    if any(own_checkpoint(Path(str(run_dir)), value) for value in named):
        # A resume from one of the run's own (older) checkpoints: once more from there would
        # set aside everything the run trained since; the run goes on from its newest.
        out["run"] = {**run, "resume": "auto"}
        if "ckpt_path" in out:
            out["ckpt_path"] = None
    return out


def own_checkpoint(run_dir: Path, value: Any) -> bool:
    """Whether ``value`` (``run.resume`` or ``--ckpt_path``) names a file or folder in the
    checkpoints folder of the run in ``run_dir``."""
    from nanolab.callbacks.rundir import CHECKPOINT_DIR

    if not isinstance(value, str) or value in ("auto", "never", "last", "hpc"):
        return False
    try:
        Path(value).resolve().relative_to((run_dir / CHECKPOINT_DIR).resolve())
    except (ValueError, OSError):
        return False
    return True


def write_config_yaml(parser: Any, config: Any, path: Path) -> None:
    """The merged config as YAML, nanolab's own model/data classes in the short form
    (``model: {gpt: ...}``, as written before they became choices), as the run records it
    (:func:`as_recorded`); written atomically."""
    import yaml

    from nanolab.runlog import CONFIG_HEADER
    from nanolab.training.resolve import plain_config

    data = yaml.safe_load(parser.dump(config, skip_none=False, skip_validation=True))
    data.pop("config", None)  # the --config files it was merged from: not part of the run
    data = as_recorded(plain_config(data))
    write_whole(path, CONFIG_HEADER + yaml.safe_dump(data, sort_keys=False))


class RunConfigWriter(Callback):
    """Writes the run's merged config as ``config.yaml`` into the run directory when training
    starts.

    Lightning's own saver writes into ``trainer.log_dir``, which moves into the logger's folder
    (``lightning_logs/version_0/``) as soon as a logger is on; the run directory is where
    ``nanolab report``, the queue and a resume look for it. ``config`` is also what the run
    log's start record describes (``jsonl.run_config``). Not at setup: a resume the checkpoint
    restore then refuses (another optimizer, a changed model) would have replaced the run's
    config with the refused one. ``nanolab fit`` puts this callback first, so the banner, which
    reads the file at the same hook, reads this launch's.
    """

    def __init__(self, parser: Any, config: Any) -> None:
        self.parser, self.config = parser, config
        self.saved = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.saved:
            return
        if trainer.is_global_zero:
            run_dir = Path(trainer.default_root_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            write_config_yaml(self.parser, self.config, run_dir / "config.yaml")
        self.saved = trainer.strategy.broadcast(True)
